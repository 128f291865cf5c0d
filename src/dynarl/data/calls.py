"""Correlated calls from the controller to one worker: requests awaiting their replies.

A call is sent with a fresh correlation id (``corr``) and ends with the reply that
says no more follow (a :class:`~dynarl.data.wire.Pong`, or a
:class:`~dynarl.data.wire.Reply` with ``more=False``); a streamed call gets several
replies before that. A call whose worker is gone fails with
:class:`~dynarl.data.errors.PeerLostError`. Replies to calls the caller has given up
on are dropped quietly.
"""

from collections import deque
from typing import Self

import anyio

from dynarl.data.errors import PeerLostError
from dynarl.data.peers import WorkerState


class Call:
    """One call in flight: the replies received and not yet read, and how it ended.

    Read it with :meth:`receive` or ``async for``; the router opens and closes it.
    """

    __slots__ = ("_replies", "_wake", "done", "error", "worker")

    def __init__(self, worker: WorkerState) -> None:
        self.worker = worker
        self.done = False
        """The last reply arrived (or the call failed)."""
        self.error: Exception | None = None
        """Why the call failed, if it did."""
        self._replies: deque[bytes] = deque()
        self._wake = anyio.Event()

    def deliver(self, body: bytes, *, more: bool) -> None:
        """A reply arrived; ``more`` says whether further ones follow."""
        self._replies.append(body)
        self.done = not more
        self._wake.set()

    def fail(self, error: Exception) -> None:
        """End the call with ``error`` (raised by the next :meth:`receive` once the
        replies already received have been read)."""
        if not self.done:
            self.error = error
            self.done = True
            self._wake.set()

    async def receive(self) -> bytes:
        """The next reply's body, waiting for it; ``anyio.EndOfStream`` after the last.

        Raises :class:`PeerLostError` if the worker went away before the last reply.
        """
        while not self._replies:
            if self.done:
                if self.error is not None:
                    raise self.error
                raise anyio.EndOfStream
            self._wake = anyio.Event()
            await self._wake.wait()
        return self._replies.popleft()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class Calls:
    """The calls in flight, by correlation id."""

    def __init__(self) -> None:
        self._pending: dict[int, Call] = {}
        self._next_corr = 1

    def open(self, worker: WorkerState) -> tuple[int, Call]:
        """A new call to ``worker`` and its correlation id."""
        corr = self._next_corr
        self._next_corr += 1
        call = Call(worker)
        self._pending[corr] = call
        return corr, call

    def close(self, corr: int) -> None:
        """Forget a call (its remaining replies are dropped)."""
        self._pending.pop(corr, None)

    def deliver(self, worker: WorkerState, corr: int, body: bytes, *, more: bool) -> None:
        """Hand a reply from ``worker`` to its call, if the call is still open and was
        addressed to that worker."""
        call = self._pending.get(corr)
        if call is not None and call.worker is worker and not call.done:
            call.deliver(body, more=more)

    def fail_worker(self, worker: WorkerState) -> None:
        """``worker`` is gone: every call to it fails."""
        for call in self._pending.values():
            if call.worker is worker:
                call.fail(PeerLostError(f"worker {worker.instance!r} is gone"))

    def __len__(self) -> int:
        """Calls open."""
        return len(self._pending)
