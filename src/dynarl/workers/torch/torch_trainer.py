"""The torch elastic trainer behind the :class:`~dynarl.workers.trainer.Trainer`
protocol: a :class:`~dynarl.workers.torch.trainer_pool.TrainerPool` (whose workers
the launcher started), its calls run one at a time.

:meth:`TorchTrainer.between_steps` holds the pool between two calls for the task that
entered it; that task's own calls inside go straight through, every other task's wait.
"""

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from dynarl.core.ids import InstanceId
from dynarl.workers.errors import RankLostError, TrainerRecoveredError
from dynarl.workers.torch.trainer_pool import TrainerPool
from dynarl.workers.trainer import ResizeResult, StepMetrics
from dynarl.workers.weights import WeightManifest, WeightSyncGroup

T = TypeVar("T")


class TorchTrainer:
    """An elastic data-parallel trainer over pre-started worker processes.

    Args:
        pool: the (not yet started) pool of worker processes.
    """

    def __init__(self, pool: TrainerPool) -> None:
        self.pool = pool
        self._lock = anyio.Lock()
        self._holder: anyio.TaskInfo | None = None

    @property
    def num_workers(self) -> int:
        """Worker processes in the pool."""
        return self.pool.num_workers

    @property
    def members(self) -> tuple[int, ...]:
        """Workers that are ranks now (none while parked)."""
        return self.pool.members

    @property
    def parked(self) -> bool:
        """Whether the trainer holds no devices."""
        return self.pool.parked

    @property
    def dead(self) -> frozenset[int]:
        """Workers whose process died and was not admitted back."""
        return self.pool.dead

    async def admit(self, workers: tuple[int, ...]) -> None:
        """Take back dead ``workers``, whose processes were started again (no ranks
        yet)."""
        await self._run(self.pool.admit, workers)

    async def start(self, members: tuple[int, ...]) -> None:
        """Join the workers into one group and make ``members`` the ranks."""
        await self._run(self.pool.start)
        await self._run(self.pool.start_training, members)

    async def aclose(self) -> None:
        """Shut the workers down, also when cancelled."""
        with anyio.CancelScope(shield=True):
            await self.pool.close()

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold the trainer between two calls (see the module docstring)."""
        async with self._lock:
            self._holder = anyio.get_current_task()
            try:
                yield
            finally:
                self._holder = None

    def rank_instances(self) -> list[InstanceId]:
        """The data router's instance of each rank, in data-parallel order."""
        return [InstanceId(name) for name in self.pool.rank_instances]

    async def train_step(self, shards: Sequence[Sequence[str]]) -> StepMetrics:
        """One optimizer step on the samples routed to the ranks (``shards[r]``: rank
        ``r``'s item ids)."""
        metrics = await self._run(self.pool.train_on_items, shards)
        assert metrics is not None, "an applied step has metrics"
        return metrics

    async def finish_step(self, shards: Sequence[Sequence[str]]) -> None:
        """The ranks complete ``shards``' samples without training on them."""
        await self._run(lambda: self.pool.train_on_items(shards, apply=False))

    async def resize(self, members: tuple[int, ...]) -> ResizeResult:
        """Make ``members`` the ranks (create-before-destroy)."""
        return await self._run(self.pool.resize, members)

    async def park(self) -> ResizeResult:
        """Give up every device."""
        return await self._run(self.pool.park)

    async def save_checkpoint(self, path: str) -> None:
        """Write rank 0's model and optimizer state to ``path``."""
        await self._run(self.pool.save_checkpoint, path)

    async def load_checkpoint(self, path: str) -> None:
        """Continue every rank from ``path``."""
        await self._run(self.pool.load_checkpoint, path)

    @property
    def weight_sync_ready(self) -> bool:
        """Whether rank 0 is the sender of the weight-sync group."""
        pool = self.pool
        return pool.sync_sender is not None and pool.sync_sender == pool.holder

    async def host_weight_sync(self, host: str, world_size: int, timeout_s: float) -> int:
        """Rank 0 opens the store of a weight-sync group of ``world_size`` on a free
        port of ``host``; returns the port."""
        return await self._run(
            lambda: self.pool.open_weight_sync(host, world_size, timeout_s=timeout_s)
        )

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Rank 0 joins ``group`` as its sender."""
        await self._run(
            lambda: self.pool.connect_weight_sync(
                group.host, group.port, group.world_size, timeout_s=group.timeout_s
            )
        )

    async def weight_manifest(self, version: int) -> WeightManifest:
        """What :meth:`send_weights` of ``version`` broadcasts."""
        return await self._run(self.pool.weight_manifest, version)

    async def send_weights(self, version: int) -> int:
        """Broadcast the weights tagged ``version`` as :meth:`weight_manifest`
        described them; returns bytes sent."""
        return await self._run(self.pool.sync_weights, version)

    async def leave_weight_sync(self) -> None:
        """The sender leaves the weight-sync group."""
        await self._run(self.pool.leave_weight_sync)

    async def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._holder is not None and self._holder == anyio.get_current_task():
            return await self._recovering(fn, *args)
        async with self._lock:
            return await self._recovering(fn, *args)

    async def _recovering(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)``; if a worker dies meanwhile, the pool rebuilds itself from the
        survivors (when it can) and :class:`TrainerRecoveredError` says so."""
        try:
            return await fn(*args)
        except RankLostError as lost:
            why = self.pool.cannot_recover
            if why is not None:
                raise RankLostError(f"{lost}; {why}", worker=lost.worker) from lost
            error = lost
        with anyio.CancelScope(shield=True):  # a half-rebuilt world is worse than a wait
            recovery = await self.pool.recover()
        raise TrainerRecoveredError(
            f"{error}; the trainer went on with workers {list(recovery.members)} after "
            f"{recovery.elapsed_s:.2f} s",
            recovery=recovery,
        ) from error
