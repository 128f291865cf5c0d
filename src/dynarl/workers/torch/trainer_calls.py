"""How a trainer pool reaches its worker processes: one command sent to many workers
at once and one reply gathered from each, over the data plane.

A worker that is gone (the data router reports its closed connection at once) makes
the call raise :class:`~dynarl.workers.errors.RankLostError` and is recorded in
:class:`~dynarl.workers.torch.trainer_recovery.Casualties`; calls are then refused
until the pool rebuilt itself. A worker that does not answer within the timeout makes
the calls *broken* for good: a collective may be half done, and nothing can tell.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import msgspec

from dynarl.data.errors import DataPlaneError
from dynarl.workers.errors import RankLostError, TrainerError
from dynarl.workers.torch.trainer_commands import Command, Failed, Reply
from dynarl.workers.torch.trainer_recovery import Casualties


class WorkerChannel(Protocol):
    """One trainer worker, as the pool reaches it."""

    @property
    def name(self) -> str:
        """The worker's name (its instance id at the data router)."""
        ...

    async def call(self, body: bytes) -> bytes:
        """Send a command's bytes and return the reply's; raises
        :class:`~dynarl.data.errors.DataPlaneError` if the worker is gone."""
        ...


class WorkerCalls:
    """Typed calls to ``workers`` (worker ``i`` is ``workers[i]``), each bounded by
    ``timeout_s``."""

    def __init__(self, workers: Sequence[WorkerChannel], *, timeout_s: float) -> None:
        self.workers = list(workers)
        self.timeout_s = timeout_s
        self.casualties = Casualties()
        self.broken = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)

    async def call(self, workers: Sequence[int] | range, command: Command) -> list[Reply]:
        """Send ``command`` to ``workers`` at once and gather one reply from each."""
        return await self.call_each(workers, lambda _: command)

    async def call_each(
        self, workers: Sequence[int] | range, command: Callable[[int], Command]
    ) -> list[Reply]:
        """Send ``command(w)`` to each worker ``w`` at once and gather the replies.

        Raises :class:`RankLostError` if a worker is gone (then every call is refused
        until the pool rebuilt itself, see :class:`Casualties`), and
        :class:`TrainerError` (marking the calls broken) if one does not answer within
        the timeout, or a worker dies while the pool rebuilds itself."""
        if self.broken:
            raise TrainerError("the pool lost track of a worker; close it and start a new one")
        self.casualties.refuse()
        replies: dict[int, Reply] = {}
        lost: list[RankLostError] = []

        async def one(w: int) -> None:
            try:
                body = await self.workers[w].call(self._encoder.encode(command(w)))
            except DataPlaneError as error:
                lost.append(RankLostError(f"trainer worker {w} died: {error}", worker=w))
                tg.cancel_scope.cancel()
                return
            replies[w] = self._decoder.decode(body)

        with anyio.move_on_after(self.timeout_s) as deadline:
            async with anyio.create_task_group() as tg:
                for w in workers:
                    tg.start_soon(one, w)
        if lost:
            self.casualties.record({e.worker for e in lost})
            if self.casualties.rebuilding:
                self.broken = True  # a second loss while rebuilding: give up
            raise lost[0]
        if deadline.cancelled_caught:
            self.broken = True
            waiting = sorted(set(workers) - replies.keys())
            raise TrainerError(f"trainer workers {waiting} did not answer in time")
        return [replies[w] for w in workers]


def check(replies: list[Reply]) -> list[Reply]:
    """``replies``, or :class:`TrainerError` naming each worker that failed."""
    failures = [r for r in replies if isinstance(r, Failed)]
    if failures:
        raise TrainerError(describe(failures), worker=failures[0].worker)
    return replies


def describe(failures: list[Failed]) -> str:
    """One line naming each failed worker and its error."""
    return "; ".join(f"worker {f.worker}: {f.error}: {f.message}" for f in failures)
