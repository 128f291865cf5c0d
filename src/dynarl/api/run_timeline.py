"""A real run's device-allocation timeline across resumes.

A resumed run continues its predecessors' timeline: their lines come first, then what
this run's recorder saw, the open intervals ending now. "Now" is the controller's
clock while the run is open (or, read off the loop from a thread, the last event's
time) and the instant the run closed after it has.
"""

from dynarl.core.clock import Clock
from dynarl.obs.timeline import TimelineLine, TimelineRecorder


class RunTimeline:
    """Predecessors' timeline lines, this run's recorder, and when the run closed."""

    def __init__(self) -> None:
        self.before: list[TimelineLine] = []
        """A resumed run's predecessors' lines."""
        self.recorder: TimelineRecorder | None = None
        """This run's recorder, once it is open."""
        self._clock: Clock | None = None
        self._closed_s: float | None = None

    def open(self, recorder: TimelineRecorder, clock: Clock) -> None:
        """The run opened: ``recorder`` records it on ``clock``."""
        self.recorder, self._clock, self._closed_s = recorder, clock, None

    def now_s(self) -> float:
        """The timeline's now (the run must have opened)."""
        assert self.recorder is not None and self._clock is not None
        if self._closed_s is not None:
            return self._closed_s
        try:
            return self._clock.now()
        except RuntimeError:  # called off the loop (a thread): the last event's time
            return self.recorder.graph.now_s

    def elapsed_s(self) -> float:
        """Seconds since the run first started (across resumes), now; 0 before it opens."""
        if self.recorder is None:
            return 0.0
        return self.now_s() - self.recorder.origin_s

    def lines(self) -> list[TimelineLine]:
        """The timeline so far, predecessors' included (the open intervals end now)."""
        if self.recorder is None:
            return list(self.before)
        return [*self.before, *self.recorder.lines(now_s=self.now_s())]

    def close(self) -> None:
        """The run closed: the timeline's now stays at this instant."""
        self._closed_s = self.now_s()
