"""The device-allocation timeline: which component held each device, and when.

:class:`TimelineRecorder` is a controller listener (``Controller(listeners=[...])``):
on every placement event it reads the hypergraph and closes the interval of each
device whose holder changed. A device is held by a component's active instance, is
``migrating`` (its instance is being drained, or it is in transit), or is ``free``.
The timeline is written as JSON lines (``timeline.jsonl``): one line per interval and
one per iteration boundary, each tagged with the run (the scheduling mode). In runs
with multi-turn episodes, the tool component (off the devices) is on it too: a line
each time the number of sessions out on tool calls changes.
"""

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import DeviceId

MIGRATING = "migrating"
"""Label of a device between two components."""
FREE = "free"
"""Label of a device no component holds."""

_PLACEMENT_EVENTS = (ev.MigrationStarted, ev.MigrationDone, ev.MigrationFailed, ev.WorkerFailed)
_TOOL_EVENTS = (ev.ToolCallStarted, ev.ToolCallFinished, ev.ItemCompleted)
# What each event type the recorder reads is to it, looked up by the event's type: the
# recorder hears every event of a run, and most are none of these (a chain of
# isinstance tests over them was 2% of an agentic simulation's wall time).
_KIND_OF: dict[type, str] = {
    **dict.fromkeys(_PLACEMENT_EVENTS, "placement"),
    **dict.fromkeys(_TOOL_EVENTS, "tool"),
    ev.IterationStarted: "iteration_start",
    ev.IterationDone: "iteration_end",
}


class Interval(msgspec.Struct, frozen=True, kw_only=True, tag="interval", tag_field="kind"):
    """``device`` was held by ``component`` from ``start_s`` to ``end_s``."""

    run: str
    device: int
    component: str
    start_s: float
    end_s: float


class Mark(msgspec.Struct, frozen=True, kw_only=True, tag="mark", tag_field="kind"):
    """An iteration boundary (``what`` is ``iteration_start`` or ``iteration_end``)."""

    run: str
    what: str
    iteration: int
    time_s: float


class ToolLoad(msgspec.Struct, frozen=True, kw_only=True, tag="tool", tag_field="kind"):
    """From ``time_s`` on, ``num_in_tool`` sessions were out of their engines on tool
    calls (the tool component's load)."""

    run: str
    time_s: float
    num_in_tool: int


TimelineLine = Interval | Mark | ToolLoad


class TimelineRecorder:
    """Records device -> component intervals from controller events; times are
    seconds since the recorder was made.

    Args:
        graph: the controller's hypergraph (read after each placement event).
        run: the run's name in the written lines (e.g. the scheduling mode).
        offset_s: the time of the recorder's start in the written lines (a resumed run
            continues its predecessor's timeline).
        now_s: the recorder's start on the graph's clock (default: the graph's last
            event time).
    """

    def __init__(
        self,
        graph: Hypergraph,
        *,
        run: str = "",
        offset_s: float = 0.0,
        now_s: float | None = None,
    ) -> None:
        self.graph = graph
        self.run = run
        self.intervals: list[Interval] = []
        self.marks: list[Mark] = []
        self.origin_s = (graph.now_s if now_s is None else now_s) - offset_s
        self._open: dict[DeviceId, tuple[str, float]] = {
            DeviceId(d): (self._label(DeviceId(d)), offset_s) for d in range(graph.num_devices)
        }
        self._last: dict[DeviceId, int] = {}  # index of each device's last closed interval
        self.tool_loads: list[ToolLoad] = []
        self._in_tool = 0

    def __call__(self, event: ev.Event) -> None:
        """Listener: update on placement events and iteration boundaries."""
        kind = _KIND_OF.get(type(event))
        if kind is None:
            return
        if kind == "placement":
            self._refresh(event.time_s)
        elif kind == "tool":
            in_tool = sum(e.num_in_tool for e in self.graph.edges.values())
            if in_tool != self._in_tool:
                self._in_tool = in_tool
                self.tool_loads.append(
                    ToolLoad(run=self.run, time_s=event.time_s - self.origin_s, num_in_tool=in_tool)
                )
        else:
            assert isinstance(event, ev.IterationStarted | ev.IterationDone)
            self.marks.append(
                Mark(
                    run=self.run,
                    what=kind,
                    iteration=event.iteration,
                    time_s=event.time_s - self.origin_s,
                )
            )

    def close(self, now_s: float) -> None:
        """End every open interval at ``now_s`` (the run is over)."""
        now_s -= self.origin_s
        for d, (label, since) in self._open.items():
            if now_s > since:
                self.intervals.append(
                    Interval(run=self.run, device=d, component=label, start_s=since, end_s=now_s)
                )
            self._open[d] = (label, now_s)

    def device_seconds(self, start_s: float, end_s: float) -> dict[str, float]:
        """Device-seconds per label between ``start_s`` and ``end_s`` (on the clock the
        events were stamped with; closed intervals only: call :meth:`close` first)."""
        start_s -= self.origin_s
        end_s -= self.origin_s
        out: dict[str, float] = {}
        for iv in self.intervals:
            overlap = min(iv.end_s, end_s) - max(iv.start_s, start_s)
            if overlap > 0:
                out[iv.component] = out.get(iv.component, 0.0) + overlap
        return out

    def lines(self, now_s: float | None = None) -> Iterator[TimelineLine]:
        """Every interval and mark, in time order; with ``now_s`` (on the events' clock)
        the open intervals too, as if they ended then (the timeline so far)."""
        items: list[TimelineLine] = [*self.intervals, *self.marks, *self.tool_loads]
        if now_s is not None:
            end_s = now_s - self.origin_s
            items += [
                Interval(run=self.run, device=d, component=label, start_s=since, end_s=end_s)
                for d, (label, since) in self._open.items()
                if end_s > since
            ]
        yield from sorted(items, key=lambda x: x.start_s if isinstance(x, Interval) else x.time_s)

    def _label(self, d: DeviceId) -> str:
        owner = self.graph.device_owner.get(d)
        if owner is None:
            return FREE
        node = self.graph.instances.get(owner) if isinstance(owner, str) else None
        if node is None or node.state != "active":
            return MIGRATING
        return str(node.component)

    def _refresh(self, now_s: float) -> None:
        now_s -= self.origin_s
        for d, (label, since) in self._open.items():
            new = self._label(d)
            if new == label:
                continue
            if now_s > since:
                self._last[d] = len(self.intervals)
                self.intervals.append(
                    Interval(run=self.run, device=d, component=label, start_s=since, end_s=now_s)
                )
            elif (k := self._last.get(d)) is not None and (
                (prev := self.intervals[k]).component == new and prev.end_s == since
            ):
                # It held ``label`` for no time (a device that arrived and left at the
                # same instant): its last interval goes on.
                self.intervals[k] = self.intervals[-1]
                self.intervals.pop()
                for dev, idx in self._last.items():
                    if idx == len(self.intervals):
                        self._last[dev] = k
                del self._last[d]
                self._open[d] = (new, prev.start_s)
                continue
            self._open[d] = (new, now_s)


def write_timeline(path: str | Path, recorders: Iterable[TimelineRecorder]) -> None:
    """Write the recorders' lines as JSON lines to ``path``."""
    write_lines(path, [line for rec in recorders for line in rec.lines()])


def write_lines(path: str | Path, lines: Iterable[TimelineLine]) -> None:
    """Write timeline ``lines`` as JSON lines to ``path``, replacing it atomically (a
    reader never sees half a file)."""
    encoder = msgspec.json.Encoder()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        for line in lines:
            out.write(encoder.encode(line) + b"\n")
    os.replace(tmp, path)


def read_timeline(path: str | Path) -> list[TimelineLine]:
    """Read a file written by :func:`write_timeline`."""
    decoder = msgspec.json.Decoder(TimelineLine)
    with Path(path).open("rb") as src:
        return [decoder.decode(line) for line in src if line.strip()]
