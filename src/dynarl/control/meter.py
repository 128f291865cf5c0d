"""Rate meters: exponentially decayed work rates measured from event timestamps."""

import math


class RateMeter:
    """Rate of work per second, decayed with time constant ``tau_s``.

    Each :meth:`add` records ``amount`` units of work done at ``time_s``; :meth:`rate`
    is the exponentially weighted rate at a time. O(1) per call, no history kept.
    """

    __slots__ = ("_last_s", "_mass", "_start_s", "tau_s")

    def __init__(self, tau_s: float = 5.0) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s must be positive, got {tau_s}")
        self.tau_s = tau_s
        self._mass = 0.0
        self._last_s: float | None = None
        self._start_s: float | None = None

    def add(self, time_s: float, amount: float) -> None:
        """Record ``amount`` units of work finished at ``time_s``."""
        if self._last_s is None:
            self._last_s = self._start_s = time_s
        elif time_s > self._last_s:
            self._mass *= math.exp(-(time_s - self._last_s) / self.tau_s)
            self._last_s = time_s
        self._mass += amount

    def rate(self, time_s: float) -> float:
        """Units per second around ``time_s`` (0 before any work)."""
        if self._last_s is None or self._start_s is None:
            return 0.0
        decayed = self._mass * math.exp(-max(0.0, time_s - self._last_s) / self.tau_s)
        # Over a span shorter than tau the decayed mass covers only that span.
        span = max(time_s - self._start_s, 1e-3)
        window = self.tau_s * (1.0 - math.exp(-span / self.tau_s))
        return decayed / window

    def age(self, time_s: float) -> float:
        """Seconds since its first work (0 before any)."""
        return 0.0 if self._start_s is None else max(0.0, time_s - self._start_s)

    def reset(self) -> None:
        """Forget all work (a new iteration, a resized component)."""
        self._mass = 0.0
        self._last_s = self._start_s = None
