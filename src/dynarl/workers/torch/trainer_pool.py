"""The driver side of the elastic trainer: a pool of pre-started worker processes,
some of which are the trainer's data-parallel ranks at any moment.

The workers are started by a launcher and are peers of the controller's data router,
as device slots are; the pool reaches each through a :class:`WorkerChannel` (a typed
call over the data plane) and never touches a process. It joins them to one world
process group (a TCP rendezvous, so they may be anywhere: a
:class:`~dynarl.workers.torch.pool_world.PoolWorld`), then only sends commands:
train steps to the members, resizes to everyone. A resize prepares the new group and
the joiners' state while the old group stays intact, and switches only when every
worker reported ready; otherwise it aborts and raises
:class:`~dynarl.workers.errors.ReshardError` with the old group in place.

A worker that dies makes the call that meets it raise :class:`RankLostError`; the pool
then refuses every call but :meth:`TrainerPool.recover`, which rebuilds the world from
the survivors and restores one consistent trainer state on them (see there). A dead
worker whose process the launcher started again comes back with
:meth:`TrainerPool.admit`.

This module does not import torch; the workers do.
"""

import logging
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dynarl.workers.errors import ReshardError, TrainerError, WeightSyncError
from dynarl.workers.torch import trainer_recovery
from dynarl.workers.torch.pool_world import PoolWorld
from dynarl.workers.torch.trainer_calls import WorkerChannel, describe
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    CommitResize,
    Done,
    Failed,
    LoadCheckpoint,
    PrepareReshard,
    PrepareResize,
    Reply,
    ReshardFault,
    SaveCheckpoint,
    StartTraining,
    StepDone,
    TrainOnItems,
    TrainStep,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.weight_sender import WeightSender
from dynarl.workers.trainer import Minibatch, Recovery, ResizeResult, StepMetrics
from dynarl.workers.trainer_items import to_array
from dynarl.workers.weights import WeightManifest

logger = logging.getLogger(__name__)


class TrainerPool:
    """An elastic data-parallel trainer over pre-started worker processes, reached
    through ``workers`` (worker ``i`` is ``workers[i]``)::

        pool = TrainerPool(config, workers=channels, model_factory=f, loss_fn=weighted_nll)
        await pool.start()
        await pool.start_training([0])
        await pool.train_step(minibatch)
        await pool.resize([0, 1, 2, 3])
        await pool.close()

    ``model_factory`` and ``loss_fn`` must be picklable (module-level functions,
    ``functools.partial`` of classes and configs): they go to the workers once, at
    start. ``host`` is where worker 0 hosts the world group's rendezvous (its machine).
    Calls run one at a time (the caller serialises them).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        workers: Sequence[WorkerChannel],
        model_factory: Any,
        loss_fn: Any,
        host: str = "127.0.0.1",
    ) -> None:
        if not workers:
            raise TrainerError("a pool needs at least 1 worker")
        self.config = config
        self.workers = list(workers)
        self.host = host
        self._model_factory = model_factory
        self._loss_fn = loss_fn
        self._members: tuple[int, ...] = ()
        self._parked = False
        self._epoch = 0
        self._started = False
        self._world = PoolWorld(self.workers, config=config, host=host)
        self.sender = WeightSender(self._world.calls)
        """The weight-sync group's sending worker."""
        self._resizing_to: tuple[int, ...] | None = None  # the members a resize prepares
        self.resize_listeners: list[Callable[[PrepareResize | PrepareReshard], None]] = []
        """Called as a resize starts, with the prepare command every worker is sent
        (a fault injector kills a worker there)."""
        self._num_steps: int | None = None  # the trainer's optimizer steps, when known

    @property
    def num_workers(self) -> int:
        """Workers in the pool."""
        return len(self.workers)

    @property
    def members(self) -> tuple[int, ...]:
        """Workers that are trainer ranks now, in data-parallel rank order (none while
        the trainer is parked)."""
        return () if self._parked else self._members

    @property
    def holder(self) -> int | None:
        """The worker holding the trainer's state: rank 0, or the parked state's keeper."""
        return self._members[0] if self._members else None

    @property
    def parked(self) -> bool:
        """Whether the trainer holds no devices (see :meth:`park`)."""
        return self._parked

    @property
    def dead(self) -> frozenset[int]:
        """Workers that died (until :meth:`admit` takes their restarted processes)."""
        return frozenset(self._world.calls.casualties.dead)

    @property
    def can_recover(self) -> bool:
        """Whether :meth:`recover` can rebuild the trainer around a lost worker."""
        return self.cannot_recover is None

    @property
    def cannot_recover(self) -> str | None:
        """Why :meth:`recover` cannot rebuild the trainer around a lost worker now
        (``None``: it can; a torch trainer always can, a backend whose layout spreads
        one copy of the state over several workers may not)."""
        return None

    @property
    def num_steps(self) -> int | None:
        """Optimizer steps the trainer has taken, when the pool knows (it does from
        the start and after every step; not right after a checkpoint is loaded)."""
        return self._num_steps

    async def start(self) -> None:
        """Join every worker to the world group (worker 0 hosts it at ``host``)."""
        if self._started:
            raise TrainerError("the pool is already started")
        code = self._code()
        self._started = True
        await self._world.join(code)
        logger.info("joined %d trainer workers", self.num_workers)

    async def start_training(self, members: Sequence[int]) -> None:
        """Make ``members`` the trainer's ranks, with fresh weights from the seed (a
        trainer already running is dropped: this is also a restart)."""
        members = self._valid_members(members)
        await self._world.call_checked(self._world.indices, StartTraining(members=members))
        self._members = members
        self._parked = False
        self._num_steps = 0

    async def train_step(self, minibatch: Minibatch) -> StepMetrics:
        """One optimizer step on the global ``minibatch``, split over the members."""
        if self._parked:
            raise TrainerError("the trainer is parked (it holds no devices); resize it first")
        arrays = {name: to_array(a) for name, a in minibatch.items()}
        replies = await self._world.call_checked(self._members, TrainStep(minibatch=arrays))
        assert isinstance(replies[0], StepDone)
        self._num_steps = replies[0].metrics.num_steps
        return replies[0].metrics

    @property
    def rank_instances(self) -> list[str]:
        """The data router's instance of each rank, in data-parallel order."""
        return [self.workers[m].name for m in self.members]

    async def train_on_items(
        self, shards: Sequence[Sequence[str]], *, apply: bool = True
    ) -> StepMetrics | None:
        """One optimizer step on the samples the data router delivered to the members:
        ``shards[r]`` are rank ``r``'s item ids, in order (each worker completes its
        items afterwards). Without ``apply`` the members only complete the items (the
        step was applied before a rank was lost) and ``None`` is returned."""
        if self._parked:
            raise TrainerError("the trainer is parked (it holds no devices); resize it first")
        members = self._members
        if len(shards) != len(members):
            raise TrainerError(f"{len(shards)} shards for {len(members)} ranks")
        rank = {m: r for r, m in enumerate(members)}
        replies = await self._world.call_each_checked(
            members, lambda w: TrainOnItems(item_ids=tuple(shards[rank[w]]), apply=apply)
        )
        return self._stepped(replies) if apply else None

    def _stepped(self, replies: list[Reply]) -> StepMetrics:
        assert isinstance(replies[0], StepDone)
        self._num_steps = replies[0].metrics.num_steps
        return replies[0].metrics

    async def resize(
        self,
        members: Sequence[int],
        *,
        source: int | None = None,
        fault: ReshardFault | None = None,
    ) -> ResizeResult:
        """Make ``members`` the trainer's ranks (create-before-destroy).

        Joiners receive parameters, buffers and AdamW state from ``source`` (default:
        the first current member that stays, else the first current member; from a
        parked trainer, its keeper). On any failure every worker drops what the resize
        prepared, the old members keep training (or the trainer stays parked), and
        :class:`ReshardError` is raised.
        """
        new = self._valid_members(members)
        if self._parked and new == self._members:
            self._parked = False  # the keeper becomes the only rank again: no transfer
            return ResizeResult(
                epoch=self._epoch, old_members=(), new_members=new, elapsed_s=0.0, bytes_moved=0
            )
        old = self._members
        if not old:
            raise TrainerError("the trainer has no members yet; call start_training first")
        if source is None:
            source = next((m for m in old if m in new), old[0])
        if source not in old:
            raise ReshardError(f"source worker {source} is not a member of {old}")
        self._epoch += 1
        started = time.perf_counter()
        prepare = PrepareResize(
            epoch=self._epoch, old_members=old, new_members=new, source=source, fault=fault
        )
        replies = await self._two_phase(
            prepare,
            f"resize {old} -> {new} failed and was rolled back; the old group keeps training",
        )
        self._members = new
        was_parked, self._parked = self._parked, False
        moved = sum(r.bytes_moved for r in replies if isinstance(r, Done) and r.worker == source)
        result = ResizeResult(
            epoch=self._epoch,
            old_members=() if was_parked else old,
            new_members=new,
            elapsed_s=time.perf_counter() - started,
            bytes_moved=moved,
        )
        logger.info("resized %s -> %s in %.3f s", old, new, result.elapsed_s)
        return result

    async def _two_phase(self, prepare: PrepareResize | PrepareReshard, failed: str) -> list[Reply]:
        """Send ``prepare`` to every worker; if any fails, every worker drops what it
        prepared and :class:`ReshardError` says ``failed`` and why; else every worker
        commits. Returns the prepare replies.

        A worker that dies meanwhile raises :class:`RankLostError` at once (the
        survivors may still be blocked with it in ``new_group``); :meth:`recover` then
        rolls the resize back on the survivors."""
        self._resizing_to = prepare.new_members
        for listener in self.resize_listeners:
            listener(prepare)
        replies = await self._world.calls.call(self._world.indices, prepare)
        failures = [r for r in replies if isinstance(r, Failed)]
        if failures:
            await self._world.call_checked(self._world.indices, AbortResize(epoch=self._epoch))
            self._resizing_to = None
            raise ReshardError(f"{failed}. {describe(failures)}", worker=failures[0].worker)
        await self._world.call_checked(self._world.indices, CommitResize(epoch=self._epoch))
        self._resizing_to = None
        return replies

    async def recover(self) -> Recovery:
        """Rebuild the trainer after workers died (a call raised :class:`RankLostError`):
        the survivors leave the broken world, form a new one, and continue from the
        most advanced surviving state (see :mod:`~dynarl.workers.torch.trainer_recovery`).
        A step the loss interrupted is applied by every rank or by none
        (:attr:`Recovery.step_applied` says which; the caller re-runs it if none); a
        resize it interrupted is rolled back. Raises :class:`TrainerError` (the pool is
        then broken) if no rank survived with the trainer's state, a survivor fails
        meanwhile, or the trainer cannot survive a lost worker (:attr:`cannot_recover`).
        """
        why = self.cannot_recover
        if why is not None:
            self._world.calls.broken = True
            raise TrainerError(why)
        recovery = await self._world.rebuild(
            members=self._members,
            resizing_to=self._resizing_to,
            known_steps=self._num_steps,
            plan=self.recovery_plan(),
        )
        self._members = recovery.members
        self._resizing_to = None
        self._epoch += 1
        self.sender.forget_dead()
        self._num_steps = recovery.num_steps
        logger.warning(
            "trainer workers %s died; the trainer goes on with %s from worker %d's state "
            "(%d steps) after %.2f s",
            list(recovery.lost),
            list(recovery.members),
            recovery.source,
            recovery.num_steps,
            recovery.elapsed_s,
        )
        return recovery

    def recovery_plan(self) -> trainer_recovery.PlanRanks | None:
        """How :meth:`recover` chooses the new ranks (``None``: the surviving ranks,
        each holding the whole state); a backend with model-parallel ranks overrides
        it."""
        return None

    async def admit(self, workers: Sequence[int]) -> None:
        """Take back dead ``workers`` whose processes the launcher started again (under
        the same names): they join the world, holding no state, and a :meth:`resize`
        may make them ranks (see :func:`~dynarl.workers.torch.trainer_recovery.readmit`).
        Call between steps. A worker whose death no call met yet (its new process
        answers under its name) is lost first: the pool rebuilds itself without it
        (:meth:`recover`)."""
        if not self._members:
            raise TrainerError("the trainer has no members yet; call start_training first")
        casualties = self._world.calls.casualties
        unknown = set(workers) - casualties.dead
        if unknown:
            casualties.record(unknown)
            await self.recover()
        started = time.perf_counter()
        await self._world.readmit(workers, members=self._members, code=self._code())
        self._epoch += 1
        logger.info(
            "trainer workers %s rejoined the world %s in %.2f s",
            list(workers),
            self._world.indices,
            time.perf_counter() - started,
        )

    async def park(self) -> ResizeResult:
        """Give up every device: the trainer's state stays with one worker (rank 0,
        which shrinks to a data-parallel group of one first) and no train step runs
        until :meth:`resize` gives it ranks again, with that worker as the source.

        A colocated schedule parks the trainer while the other stages hold the
        devices. On a CPU device the kept state stays where it is; a GPU backend
        would offload it to host memory here.
        """
        keeper = self.holder
        if keeper is None:
            raise TrainerError("the trainer has no members yet; call start_training first")
        result = await self.resize([keeper]) if self._members != (keeper,) else None
        self._parked = True
        logger.info("parked the trainer on worker %d", keeper)
        return ResizeResult(
            epoch=self._epoch,
            old_members=() if result is None else result.old_members,
            new_members=(),
            elapsed_s=0.0 if result is None else result.elapsed_s,
            bytes_moved=0 if result is None else result.bytes_moved,
        )

    async def save_checkpoint(self, path: str | Path) -> None:
        """Write rank 0's model and optimizer state to ``path`` (``torch.save``)."""
        await self._world.call_checked(self._members[:1], SaveCheckpoint(path=str(path)))

    async def load_checkpoint(self, path: str | Path) -> None:
        """Make every member continue from the state :meth:`save_checkpoint` wrote to
        ``path`` (after :meth:`start_training`)."""
        if not self._members:
            raise TrainerError("the trainer has no members yet; call start_training first")
        await self._world.call_checked(self._members, LoadCheckpoint(path=str(path)))
        self._num_steps = None

    async def open_weight_sync(
        self, host: str, world_size: int, *, timeout_s: float | None = None
    ) -> int:
        """Open the store of a weight-sync group of ``world_size`` at the trainer's rank
        0, on a free port of ``host``; returns the port, for
        :meth:`connect_weight_sync` and the engines."""
        timeout = timeout_s if timeout_s is not None else self.config.timeout_s
        return await self.sender.open(self._holder_for_sync(), host, world_size, timeout)

    async def connect_weight_sync(
        self, host: str, port: int, world_size: int, *, timeout_s: float | None = None
    ) -> None:
        """Make the trainer's rank 0 the sender (rank 0, store host at ``host:port``,
        opened by :meth:`open_weight_sync`) of a weight-sync group of ``world_size``;
        the engines join it at the same time."""
        timeout = timeout_s if timeout_s is not None else self.config.timeout_s
        await self.sender.connect(self._holder_for_sync(), host, port, world_size, timeout)

    async def leave_weight_sync(self) -> None:
        """The sender leaves the weight-sync group (every engine of the group leaves
        at the same time); a no-op without a group."""
        await self.sender.leave()

    @property
    def sync_sender(self) -> int | None:
        """The worker that sends in the weight-sync group (``None`` without a group)."""
        return self.sender.worker

    async def weight_manifest(self, version: int) -> WeightManifest:
        """What :meth:`sync_weights` of ``version`` broadcasts (the sender describes it)."""
        return await self.sender.manifest(self.sender.checked(self._members), version)

    async def sync_weights(self, version: int) -> int:
        """Broadcast the weights tagged ``version`` to the engines, as
        :meth:`weight_manifest` described them; returns bytes sent."""
        return await self.sender.send([self.sender.checked(self._members)], version)

    def _holder_for_sync(self) -> int:
        if self.holder is None:
            raise WeightSyncError("the trainer has no members yet; call start_training first")
        return self.holder

    async def close(self) -> None:
        """Ask every worker to shut down (each tears down its process groups and
        exits); idempotent. The launcher stops what is left of the processes."""
        if not self._started:
            return
        self._started = False
        await self._world.shutdown()
        self._members = ()

    def _code(self) -> bytes:
        """The model factory and loss, pickled for the workers (at start and admit)."""
        return pickle.dumps((self._model_factory, self._loss_fn))

    def _valid_members(self, members: Sequence[int]) -> tuple[int, ...]:
        chosen = tuple(int(m) for m in members)
        if not chosen or len(set(chosen)) != len(chosen):
            raise TrainerError(f"members {chosen} must be a non-empty list of distinct workers")
        if any(not 0 <= m < self.num_workers for m in chosen):
            raise TrainerError(f"members {chosen} must be workers 0..{self.num_workers - 1}")
        dead = sorted(self._world.calls.casualties.dead.intersection(chosen))
        if dead:
            raise TrainerError(f"members {chosen}: trainer workers {dead} died")
        return chosen
