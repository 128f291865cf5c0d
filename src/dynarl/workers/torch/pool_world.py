"""The world process group of a trainer pool's workers, from the driver's side: which
workers are in it (pool indices, in world-rank order), the checked calls to them, and
the changes of its membership: the first join of every worker, the rebuild from the
survivors after a loss and the readmission of restarted workers (both in
:mod:`~dynarl.workers.torch.trainer_recovery`), and the shutdown.

The workers' side of the same group is :mod:`~dynarl.workers.torch.trainer_world`.
This module does not import torch; the workers do.
"""

import logging
from collections.abc import Callable, Sequence

import anyio

from dynarl.workers.errors import TrainerError
from dynarl.workers.torch import trainer_recovery
from dynarl.workers.torch.trainer_calls import WorkerCalls, WorkerChannel, check
from dynarl.workers.torch.trainer_commands import Command, Join, Reply, Shutdown
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.weight_sender import open_store
from dynarl.workers.trainer import Recovery

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 10.0


class PoolWorld:
    """The world group of ``workers`` (worker ``i`` is ``workers[i]``), whose
    rendezvous its first worker hosts at ``host``; each call is bounded by
    ``config.timeout_s``. What a rebuild needs of the pool
    (:class:`~dynarl.workers.torch.trainer_recovery.PoolCalls`)."""

    def __init__(
        self, workers: Sequence[WorkerChannel], *, config: TrainerConfig, host: str
    ) -> None:
        self.config = config
        self.host = host
        self.calls = WorkerCalls(workers, timeout_s=config.timeout_s)
        """The typed calls to every worker, and the workers that died."""
        self.indices: tuple[int, ...] = tuple(range(len(workers)))
        """The pool indices of the world's workers, in world-rank order."""

    async def join(self, code: bytes) -> None:
        """Join every worker to the world group (worker 0 hosts it at :attr:`host`);
        ``code`` is the pickled ``(model_factory, loss_fn)`` (see :class:`Join`)."""
        num_workers = len(self.calls.workers)
        port = await self.open_world_store(0, num_workers)
        await self.call_each_checked(
            range(num_workers),
            lambda w: Join(
                worker=w,
                num_workers=num_workers,
                host=self.host,
                port=port,
                config=self.config,
                code=code,
            ),
        )

    async def call_checked(self, workers: Sequence[int], command: Command) -> list[Reply]:
        """Send ``command`` to ``workers`` at once; their replies, or
        :class:`TrainerError` if one failed."""
        return check(await self.calls.call(workers, command))

    async def call_each_checked(
        self, workers: Sequence[int], command: Callable[[int], Command]
    ) -> list[Reply]:
        """Send ``command(w)`` to each worker ``w`` at once; their replies, or
        :class:`TrainerError` if one failed."""
        return check(await self.calls.call_each(workers, command))

    async def open_world_store(self, worker: int, world_size: int) -> int:
        """Make ``worker`` open the store of a world of ``world_size`` at :attr:`host`;
        returns its port."""
        return await open_store(
            self.calls, worker, "world", self.host, world_size, self.config.timeout_s
        )

    async def rebuild(
        self,
        *,
        members: Sequence[int],
        resizing_to: Sequence[int] | None,
        known_steps: int | None,
        plan: trainer_recovery.PlanRanks | None,
    ) -> Recovery:
        """Rebuild the world from the survivors after workers died, and the trainer of
        ``members`` on them (see :func:`~dynarl.workers.torch.trainer_recovery.rebuild`
        for the arguments); returns how. If that fails the calls are broken for good
        and the :class:`TrainerError` propagates."""
        try:
            rebuilt = await trainer_recovery.rebuild(
                self,
                self.calls.casualties,
                world=self.indices,
                members=members,
                resizing_to=resizing_to,
                known_steps=known_steps,
                host=self.host,
                plan=plan,
            )
        except TrainerError:
            self.calls.broken = True
            raise
        self.indices = rebuilt.world
        return rebuilt.recovery

    async def readmit(self, workers: Sequence[int], *, members: Sequence[int], code: bytes) -> None:
        """Take dead ``workers`` whose processes were started again back into the
        world, the trainer's ranks ``members`` keeping their state (see
        :func:`~dynarl.workers.torch.trainer_recovery.readmit`); ``code`` as for
        :meth:`join`."""
        joining = trainer_recovery.Joining(
            num_workers=len(self.calls.workers), config=self.config, code=code
        )
        self.indices = await trainer_recovery.readmit(
            self,
            self.calls.casualties,
            workers,
            world=self.indices,
            members=members,
            joining=joining,
            host=self.host,
        )

    async def shutdown(self) -> None:
        """Ask every worker of the world to shut down (each tears down its process
        groups and exits), waiting a short grace period at most; a no-op once the
        calls are broken."""
        if self.calls.broken:
            return
        with anyio.move_on_after(_SHUTDOWN_GRACE_S):
            try:
                await self.calls.call(self.indices, Shutdown())
            except TrainerError as error:
                logger.warning("trainer workers did not shut down cleanly: %s", error)
