"""The trainer worker: what a pre-started process on a device holds between its
pool's commands (:mod:`~dynarl.workers.torch.trainer_serve` runs the process's command
loop), and the handler of each command, dispatched by a table keyed on the command type.
A command that raises is answered with
:class:`~dynarl.workers.torch.trainer_commands.Failed` and the worker keeps serving.
"""

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError, WeightSyncError
from dynarl.workers.torch import reshard, trainer_world
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.rendezvous import TCPStore, open_store
from dynarl.workers.torch.train_batch import to_tensors
from dynarl.workers.torch.trainer import ElasticTrainer, ModelFactory
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    Command,
    CommitResize,
    ConnectWeightSync,
    DescribeWeights,
    Done,
    Failed,
    LeaveWeightSync,
    LeaveWorld,
    Left,
    LoadCheckpoint,
    OpenStore,
    PrepareResize,
    Rejoin,
    Reply,
    Restore,
    SaveCheckpoint,
    Shutdown,
    StartTraining,
    StepDone,
    StoreOpened,
    SyncWeights,
    TrainStep,
    WeightsDescribed,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.trainer_world import WorldGroup
from dynarl.workers.torch.weight_sync import (
    join_weight_sync_group,
    leave_weight_sync_group,
    manifest_of,
    send_by_manifest,
)
from dynarl.workers.trainer import Array, LossFn, StepMetrics

logger = logging.getLogger(__name__)


class TrainerWorker:
    """A worker's state between commands: its trainer (while it is a member), a
    prepared resize, its weight-sync group and its place in the world group.

    ``worker`` is its index in the pool, for good. It is built once it joined the world
    of every worker; after a worker died it joins one of the survivors
    (:class:`Rejoin`): see :attr:`world`."""

    def __init__(
        self,
        worker: int,
        *,
        config: TrainerConfig,
        model_factory: ModelFactory,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        self.worker = worker
        joined = tuple(range(dist.get_world_size())) if dist.is_initialized() else ()
        self.world = WorldGroup(worker, device=device, timeout_s=config.timeout_s, workers=joined)
        self.attempted = -1  # the step count the last step began from
        self.last_step: StepMetrics | None = None  # the last applied step's metrics
        self.config = config
        self.model_factory = model_factory
        self.loss_fn = loss_fn
        self.device = device
        self.trainer: ElasticTrainer | None = None
        self.pending: reshard.PendingResize | None = None
        self.sync_group: Group | None = None
        self.sync_store: TCPStore | None = None  # opened for the next ConnectWeightSync
        self._leaving = threading.Lock()  # a prepare installs its groups, or the world goes
        self._handlers: dict[type, Callable[[Any], Reply]] = {
            StartTraining: self._start,
            TrainStep: self._train_step,
            PrepareResize: self._prepare,
            CommitResize: self._commit,
            AbortResize: self._abort,
            SaveCheckpoint: self._save,
            LoadCheckpoint: self._load,
            ConnectWeightSync: self._connect,
            DescribeWeights: self._describe,
            SyncWeights: self._sync,
            LeaveWeightSync: self._leave,
            OpenStore: self._open_store,
            LeaveWorld: self._leave_world,
            Rejoin: self._rejoin,
            Restore: self._restore,
            Shutdown: lambda _: self._done(time.perf_counter()),
        }

    def handle(self, command: Command) -> Reply:
        """Carry out one command (blocking); a failure is answered with ``Failed``."""
        try:
            return self._handlers[type(command)](command)
        except Exception as error:
            logger.exception("worker %d: %s failed", self.worker, type(command).__name__)
            return Failed(worker=self.worker, error=type(error).__name__, message=str(error))

    def close(self) -> None:
        """Drop a prepared resize and the trainer (process groups go with the world)."""
        if self.pending is not None:
            reshard.abort_resize(self.pending)
        self.pending = None
        self.trainer = None
        self.sync_group = None

    def _start(self, command: StartTraining) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:
            raise TrainerError(f"resize {self.pending.epoch} is pending; abort it first")
        if self.trainer is not None:  # a restart: the previous trainer goes
            if self.trainer.group is not None:
                dist.destroy_process_group(self.trainer.group)
            reshard.release_memory(self.trainer)
            self.trainer = None
        group = dist.new_group(
            self.ranks(command.members),
            timeout=datetime.timedelta(seconds=self.config.timeout_s),
        )
        if self.worker in command.members:
            self.trainer = ElasticTrainer.build(
                self.model_factory,
                loss_fn=self.loss_fn,
                config=self.config,
                device=self.device,
                group=group,
            )
        return self._done(started)

    def _train_step(self, command: TrainStep) -> Reply:
        started = time.perf_counter()
        metrics = self._member().train_step(to_tensors(command.minibatch, self.device))
        return StepDone(worker=self.worker, metrics=metrics, elapsed_s=_since(started))

    def train_shard(self, shard: dict[str, Array]) -> Reply:
        """One optimizer step (with the other ranks) on this rank's own ``shard``."""
        started = time.perf_counter()
        tensors = to_tensors(shard, self.device) if shard else {}
        trainer = self._member()
        self.attempted = trainer.num_steps
        metrics = self.last_step = trainer.train_step(tensors, local=True)
        return StepDone(worker=self.worker, metrics=metrics, elapsed_s=_since(started))

    def _prepare(self, command: PrepareResize) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:
            raise TrainerError(f"resize {self.pending.epoch} is still pending; abort it first")
        generation = self.world.generation
        pending = reshard.create_groups(
            command, worker=self.worker, ranks=self.ranks, timeout_s=self.config.reshard_timeout_s
        )
        with self._leaving:
            # An interrupted prepare (see trainer_serve) may return after the worker
            # left the world it began in: what it built belongs to that world.
            if self.world.generation != generation:
                raise TrainerError(f"worker {self.worker} left the world during the resize")
            self.pending = pending
        moved = reshard.transfer_state(
            pending,
            command,
            worker=self.worker,
            trainer=self.trainer,
            make_skeleton=self._skeleton,
            device=self.device,
            bucket_bytes=self.config.bucket_bytes,
        )
        return self._done(started, bytes_moved=moved)

    def _commit(self, command: CommitResize) -> Reply:
        started = time.perf_counter()
        pending = self._pending(command.epoch)
        self.trainer = reshard.commit_resize(pending, worker=self.worker, trainer=self.trainer)
        self.pending = None
        return self._done(started)

    def _abort(self, command: AbortResize) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:  # absent when this worker failed creating groups
            reshard.abort_resize(self._pending(command.epoch))
            self.pending = None
        return self._done(started)

    def _save(self, command: SaveCheckpoint) -> Reply:
        started = time.perf_counter()
        # A crash mid-write leaves the previous checkpoint intact, never a torn file.
        tmp = f"{command.path}.tmp"
        torch.save(self._member().checkpoint(), tmp)
        os.replace(tmp, command.path)
        return self._done(started)

    def _load(self, command: LoadCheckpoint) -> Reply:
        started = time.perf_counter()
        trainer = self._member()
        try:
            # On the CPU: load_state_dict copies onto the model's device, and the RNG
            # state must stay a CPU tensor.
            state = torch.load(command.path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise TrainerError(f"cannot read the checkpoint {command.path}: {exc}") from exc
        trainer.load_checkpoint(state)
        return self._done(started)

    def _open_store(self, command: OpenStore) -> Reply:
        store = open_store(command.host, command.world_size, command.timeout_s)
        if command.purpose == "world":  # for a Rejoin (the first Join's is opened by serve)
            self.world.store = store
        else:
            self.sync_store = store
        return StoreOpened(worker=self.worker, port=store.port)

    @property
    def steps_interruptible(self) -> bool:
        """Whether ``LeaveWorld`` may interrupt a running step (see the serving loop):
        not here, a torch rank's step ends at once when a peer dies (each of its
        collectives spans every rank), and its thread must not go on computing on the
        state the survivors keep."""
        return False

    @contextmanager
    def in_world(self, generation: int) -> Iterator[None]:
        """Run the body only while this worker is in the world of ``generation`` (a
        ``LeaveWorld`` waits for it): a command that ``LeaveWorld`` interrupted must not
        install or apply anything after the worker reported its state. Raises
        :class:`TrainerError` if the worker left that world."""
        with self._leaving:
            if self.world.generation != generation:
                raise TrainerError(f"worker {self.worker} left the world meanwhile")
            yield

    def ranks(self, workers: Sequence[int]) -> list[int]:
        """The world ranks of pool workers ``workers``."""
        return self.world.ranks(workers)

    def _leave_world(self, command: LeaveWorld) -> Reply:
        with self._leaving:
            num_steps = self.detach_from_world()
            self.world.leave()
        return Left(
            worker=self.worker, num_steps=num_steps, attempted=self.attempted, last=self.last_step
        )

    def detach_from_world(self) -> int:
        """Before this worker leaves the world (a peer died): drop a prepared resize
        and let go of the groups built on the world, keeping the trainer state; returns
        the optimizer steps that state holds (``-1``: none). A backend whose state is
        not an :class:`ElasticTrainer` overrides this and ``Restore``'s handler."""
        if self.pending is not None:
            reshard.abort_resize(self.pending)
            self.pending = None
        trainer = self.trainer
        if trainer is None:
            return -1
        trainer.group = None  # destroyed with the world
        return trainer.num_steps

    def _rejoin(self, command: Rejoin) -> Reply:
        started = time.perf_counter()
        self.world.rejoin(command)
        return self._done(started)

    def _restore(self, command: Restore) -> Reply:
        started = time.perf_counter()
        self.trainer, moved = trainer_world.restore(
            command,
            world=self.world,
            trainer=self.trainer,
            make_skeleton=self._skeleton,
            bucket_bytes=self.config.bucket_bytes,
        )
        return self._done(started, bytes_moved=moved)

    def _connect(self, command: ConnectWeightSync) -> Reply:
        started = time.perf_counter()
        store, self.sync_store = self.sync_store, None
        self.sync_group = join_weight_sync_group(
            store=store if store is not None and store.port == command.port else None,
            host=command.host,
            port=command.port,
            rank=0,
            world_size=command.world_size,
            device=self.device,
            timeout_s=command.timeout_s,
        )
        return self._done(started)

    def _sync(self, command: SyncWeights) -> Reply:
        started = time.perf_counter()
        if self.sync_group is None:
            raise WeightSyncError(f"worker {self.worker} is not in a weight-sync group")
        trainer = self._member()
        manifest = manifest_of(
            trainer.model, version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        sent = send_by_manifest(
            trainer.model, manifest, group=self.sync_group, staging=trainer.staging
        )
        return self._done(started, bytes_moved=sent)

    def _describe(self, command: DescribeWeights) -> Reply:
        manifest = manifest_of(
            self._member().model, version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        return WeightsDescribed(worker=self.worker, manifest=manifest)

    def _leave(self, command: LeaveWeightSync) -> Reply:
        started = time.perf_counter()
        if self.sync_group is not None:
            group, self.sync_group = self.sync_group, None
            leave_weight_sync_group(group)
        return self._done(started)

    def _skeleton(self) -> ElasticTrainer:
        return ElasticTrainer.skeleton(
            self.model_factory, loss_fn=self.loss_fn, config=self.config, device=self.device
        )

    def _member(self) -> ElasticTrainer:
        if self.trainer is None:
            raise TrainerError(f"worker {self.worker} is not a trainer rank now")
        return self.trainer

    def _pending(self, epoch: int) -> reshard.PendingResize:
        if self.pending is None or self.pending.epoch != epoch:
            have = None if self.pending is None else self.pending.epoch
            raise TrainerError(f"no prepared resize {epoch} on worker {self.worker} (have {have})")
        return self.pending

    def _done(self, started: float, *, bytes_moved: int = 0) -> Done:
        return Done(worker=self.worker, elapsed_s=_since(started), bytes_moved=bytes_moved)


def _since(started: float) -> float:
    return time.perf_counter() - started
