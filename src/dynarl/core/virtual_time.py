"""An asyncio event loop on virtual time: it jumps forward whenever every task waits.

``loop.time()`` reads a virtual clock; when the loop has nothing ready to run and no
I/O pending, instead of sleeping until its next timer it moves the clock to that timer.
Everything built on the loop's time — ``anyio.sleep``, ``anyio.current_time``,
``fail_after``, :class:`~dynarl.core.clock.LoopClock` — becomes virtual, so the real
controller runs unchanged against modelled workers (trio's ``MockClock`` with
autojump is the model). Real I/O still works: where any is registered, it is polled
without blocking on every pass of the loop, so before time jumps, and a loop with no
timers blocks on I/O as usual.

Run code on it with ``asyncio.Runner(loop_factory=VirtualTimeLoop)`` (an application
or test decides that; the library starts no loop for real work, and its one blocking
entry point, :func:`dynarl.sim.run.run_simulation`, starts a virtual-time loop only in
a thread that runs none).
"""

import asyncio
import selectors
from typing import Any

import anyio


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that advances the loop's virtual clock instead of waiting."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            # No timer at all: only real I/O (or another thread) can wake the loop.
            result: list[tuple[selectors.SelectorKey, int]] = super().select(None)
            return result
        ready: list[tuple[selectors.SelectorKey, int]] = []
        if len(self.get_map()) > 1:
            # Real I/O besides the loop's own wake-up pipe (which another thread
            # writes to after it has queued its callback, so it needs no reading here):
            # poll it. A simulation has none, and the system call on every pass of the
            # loop was a tenth of its wall time.
            ready = super().select(0)
        if ready or timeout == 0:
            return ready
        self._loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and jumps to the next timer.

    Args:
        start_s: the virtual time the loop starts at.
    """

    def __init__(self, start_s: float = 0.0, **kwargs: Any) -> None:
        self._virtual_now = start_s
        self.time_jumps = 0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        """Virtual seconds since the loop's origin."""
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move virtual time forward (the selector calls this when all tasks wait)."""
        if seconds > 0:
            self._virtual_now += seconds
            self.time_jumps += 1


class VirtualClock:
    """A :class:`~dynarl.core.clock.Clock` reading one :class:`VirtualTimeLoop`'s
    time directly: the same readings as :class:`~dynarl.core.clock.LoopClock` on that
    loop, without looking up the running loop and async library on every read (the
    simulator reads the clock at every event; through ``anyio.current_time`` that
    was a twentieth of its wall time).

    Args:
        loop: the loop whose time it reads; sleep on that loop only.
    """

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        """The loop's virtual time."""
        return self._loop.time()

    async def sleep(self, seconds: float) -> None:
        """Sleep on the running loop (``anyio.sleep``)."""
        await anyio.sleep(seconds)
