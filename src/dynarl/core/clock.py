"""Clocks: where the control plane reads time.

The controller never calls ``time.monotonic`` itself; it is handed a :class:`Clock`. A
real run uses :class:`LoopClock` (the event loop's own clock, so a loop with virtual time
makes the whole controller virtual); tests that drive the hypergraph by hand use
:class:`ManualClock`.
"""

from typing import Protocol

import anyio


class Clock(Protocol):
    """Source of time for the control plane."""

    def now(self) -> float:
        """Seconds on this clock's timeline (monotonic, arbitrary origin)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock's timeline."""
        ...


class LoopClock:
    """The running event loop's clock (``anyio.current_time``).

    Under a virtual-time event loop (the simulator) this clock is virtual too.
    """

    def now(self) -> float:
        """Current time of the running loop."""
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        """Sleep on the running loop."""
        await anyio.sleep(seconds)


class ManualClock:
    """A clock that moves only when told to; ``sleep`` advances it immediately.

    For unit tests of code that reads time but is not driven by a loop.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        """The time last set or advanced to."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (never backwards)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` and yield once to the loop."""
        self.advance(max(0.0, seconds))
        await anyio.lowlevel.checkpoint()
