"""An alarm the simulated world sleeps on: it rings at a deadline or when set, whichever
comes first.

It does what ``with anyio.move_on_after(s): await event.wait()`` does on an asyncio loop
(the simulator's :class:`~dynarl.core.virtual_time.VirtualTimeLoop`), without a cancel
scope per wait: the world sleeps once per event, and the scope's entry, timeout and
cancellation delivery took a tenth of a simulation's wall time. Its timer behaves as the
scope's does -- one loop timer per wait at ``now + s``, which, if it fires before the
loop's clock reaches the deadline (the loop runs timers up to its clock resolution
early), is set again for the deadline -- so a simulation wakes at the same virtual
times, in the same order, as with the scope.
"""

import asyncio


class Alarm:
    """A flag a task waits on until it is set or a timeout passes (see the module
    docstring). A :meth:`set` while nobody waits is kept: the next :meth:`wait` returns
    after one pass of the loop, as ``anyio.Event.wait`` on a set event does."""

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0

    def is_set(self) -> bool:
        """Whether :meth:`set` was called since the last :meth:`clear`."""
        return self._set

    def set(self) -> None:
        """Ring: wake the waiting task (or the next one to wait)."""
        self._set = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def clear(self) -> None:
        """Forget a :meth:`set`."""
        self._set = False

    async def wait(self, timeout_s: float) -> None:
        """Return once set, or once the running loop's clock reaches ``timeout_s``
        from now; after one pass of the loop if already set or ``timeout_s`` is not
        positive."""
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        if loop.time() >= self._deadline:
            await asyncio.sleep(0)
            return
        self._timer = loop.call_at(self._deadline, self._ring, loop)
        try:
            if self._set:
                await asyncio.sleep(0)
                return
            self._waiter = loop.create_future()
            await self._waiter
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _ring(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer fired: wake the waiter if the deadline has come, else wait on."""
        if loop.time() >= self._deadline:
            self._timer = None
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
        else:
            self._timer = loop.call_at(self._deadline, self._ring, loop)
