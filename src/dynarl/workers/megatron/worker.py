"""The Megatron trainer worker process: the torch backend's worker (its serving loop,
command table, weight-sync membership) with a Megatron rank in place of the data-
parallel one.

What differs is what a layout of replicas needs:

- *start* builds the layout's process groups (every worker, members or not) and each
  member cuts its shard out of the HF model of the spec;
- *a step on routed items* reaches only each replica's leader; the leader shares the
  samples with its replica over the replica group before the replica steps;
- *a resize* (create-before-destroy) builds the new layout's groups beside the old
  ones and moves each model shard that a worker of the new layout lacks from the same
  shard of a source replica (parameters, AdamW moments and step; one transfer group
  per shard position, bucketed broadcasts). A worker keeps its state when it holds the
  same shard in both layouts; nothing else moves. The switch happens at commit; an
  abort drops the new groups and the received state, and the old layout trains on;
- *a reshard* (a change of tp or pp) gathers the source replica's state in the HF
  layout to its leader, which cuts each new member's shard and sends it that alone;
- *a resize with Megatron's distributed optimizer* (its AdamW state is sliced over
  the data-parallel group) makes each shard's moments whole first, moves whole shards
  as the plan says, and every member of the new layout builds a new rank that keeps
  its own slices (the three: :mod:`~dynarl.workers.megatron.resize`);
- *checkpoints and weight sync* gather replica 0's shards to its leader in the HF
  layout (:mod:`~dynarl.workers.megatron.state`);
- *a lost peer* (torch's AdamW, a copy of every shard surviving): the rank outlives
  the world, and the survivors' layout takes its shards from their holders in the new
  one, as a resize's moves do (:mod:`~dynarl.workers.megatron.recovery`); with the
  distributed optimizer the survivors make the state whole from their
  slices and the buddy copies of the dead ranks' (:mod:`~dynarl.workers.megatron.buddy`)
  and every member keeps its new slices.

Layouts are built on world ranks, which are the pool indices only until a peer dies.
"""

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dynarl.workers.errors import ReshardError, TrainerError, WeightSyncError
from dynarl.workers.megatron import recovery, resize, state
from dynarl.workers.megatron.layout import Layout, RankGroups, build_groups
from dynarl.workers.megatron.model import preload
from dynarl.workers.megatron.rank import MegatronRank
from dynarl.workers.megatron.resize import PreparedResize
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.torch import reshard
from dynarl.workers.torch.rendezvous import TCPStore
from dynarl.workers.torch.train_batch import to_tensors
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    CommitResize,
    DescribeWeights,
    Join,
    LoadCheckpoint,
    PrepareReshard,
    PrepareResize,
    Reply,
    Restore,
    SaveCheckpoint,
    StartTraining,
    StepDone,
    SyncWeights,
    TrainStep,
    WeightsDescribed,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.trainer_worker import TrainerWorker
from dynarl.workers.torch.trainer_world import join_world
from dynarl.workers.torch.weight_sync import manifest_of, send_by_manifest
from dynarl.workers.trainer import Array, LossFn

logger = logging.getLogger(__name__)


def join(command: Join, store: TCPStore | None) -> "MegatronWorker":
    """Join the world group and build the worker (the serving loop's ``join``)."""
    device, spec, loss_fn = join_world(command, store)
    if not isinstance(spec, ModelSpec):
        raise TrainerError(f"a megatron worker needs a ModelSpec, got {type(spec).__name__}")
    preload()
    return MegatronWorker(
        command.worker, config=command.config, spec=spec, loss_fn=loss_fn, device=device
    )


class MegatronWorker(TrainerWorker):
    """A worker's state between commands: its rank (while a member), a prepared
    resize, its weight-sync group."""

    def __init__(
        self,
        worker: int,
        *,
        config: TrainerConfig,
        spec: ModelSpec,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        super().__init__(
            worker, config=config, model_factory=spec.hf_model, loss_fn=loss_fn, device=device
        )
        self.spec = spec
        self.rank: MegatronRank | None = None
        self.resizing: PreparedResize | None = None
        self._hf: torch.nn.Module | None = None  # the weight-sync sender's HF layout
        self._handlers[PrepareReshard] = self._prepare_reshard

    @property
    def steps_interruptible(self) -> bool:
        """With tp or pp > 1: a survivor may wait in a collective of its replica that
        the dead worker is not in. The abandoned step updates only in the world it
        began in, and touches only its old rank (a restore copies a kept rank onto the
        new groups, :func:`~dynarl.workers.megatron.state.regrouped`)."""
        return self.rank is not None and self.rank.groups.layout.replica_size > 1

    def close(self) -> None:
        """Drop a prepared resize, the rank and its groups."""
        if self.resizing is not None:
            self.resizing.release()
        self.resizing = None
        self.rank = None
        super().close()

    def train_shard(self, shard: dict[str, Array]) -> Reply:
        """One step (with the other members) on the samples routed to this replica's
        leader (empty on the other workers of the replica, which receive them)."""
        started = time.perf_counter()
        rank = self._rank()
        mine = to_tensors(shard, self.device) if shard else {}
        if rank.groups.layout.replica_size > 1:
            mine = state.share_batch(
                mine if self.me == rank.groups.leader else None,
                group=rank.groups.replica,
                src=rank.groups.leader,
                device=self.device,
            )
        self.attempted = rank.num_steps
        guard = functools.partial(self.in_world, self.world.generation)
        metrics = self.last_step = rank.train_step(mine, local=True, guard=guard)
        return StepDone(
            worker=self.worker, metrics=metrics, elapsed_s=time.perf_counter() - started
        )

    # -- command handlers (the table of TrainerWorker dispatches to these) -------------

    def _start(self, command: StartTraining) -> Reply:
        started = time.perf_counter()
        if self.resizing is not None:
            raise TrainerError(f"resize {self.resizing.epoch} is pending; abort it first")
        if self.rank is not None:  # a restart: the previous rank goes
            self.rank.groups.destroy()
            self.rank.release()
            reshard.release_memory(self.rank)
            self.rank = None
        layout = self.layout(command.members, self.spec)
        groups = build_groups(layout, worker=self.me, timeout_s=self.config.timeout_s)
        if groups is not None:
            self.rank = MegatronRank.create(
                self.spec,
                loss_fn=self.loss_fn,
                config=self.config,
                groups=groups,
                hf_state=self.spec.hf_state(),
                device=self.device,
            )
        return self._done(started)

    def _train_step(self, command: TrainStep) -> Reply:
        started = time.perf_counter()
        guard = functools.partial(self.in_world, self.world.generation)
        metrics = self._rank().train_step(to_tensors(command.minibatch, self.device), guard=guard)
        return StepDone(
            worker=self.worker, metrics=metrics, elapsed_s=time.perf_counter() - started
        )

    def _prepare(self, command: PrepareResize) -> Reply:
        started = time.perf_counter()
        if self.resizing is not None:
            raise TrainerError(f"resize {self.resizing.epoch} is still pending; abort it first")
        old = self.layout(command.old_members, self.spec)
        new = self.layout(command.new_members, self.spec)
        if self.spec.distributed_optimizer:
            sent = self._prepare_sliced(command, old, new)
            return self._done(started, bytes_moved=sent)
        pending, groups, transfer_groups = self._begin_transfer(command, old, new)
        if groups is not None:
            probe = torch.ones(1, device=self.device)
            dist.all_reduce(probe, group=groups.members)
            if int(probe.item()) != len(new.members):
                raise ReshardError(f"the new group answered {probe.item()} to a health check")
        fault = command.fault
        hook = None
        if fault is not None and fault.worker == self.worker:
            hook = state.fault_hook(fault.after_buckets)
        moved = state.Moved()
        try:
            state.run_moves(
                transfer_groups,
                worker=self.me,
                rank=self.rank,
                make_empty=lambda: self._empty(groups),
                bucket_bytes=self.config.bucket_bytes,
                on_bucket=hook,
                moved=moved,
            )
        finally:
            pending.received = moved.received
        return self._done(started, bytes_moved=moved.sent_bytes + moved.received_bytes)

    def _begin_transfer(
        self, command: PrepareResize, old: Layout, new: Layout
    ) -> tuple[PreparedResize, RankGroups | None, list[tuple[state.Move, dist.ProcessGroup]]]:
        """The start of a data-parallel resize ``old -> new`` (layouts of world ranks):
        the new layout's groups (``None`` where this worker is not a member), the
        pending resize, and the transfer group of each move of the plan this worker
        takes part in."""
        timeout_s = self.config.reshard_timeout_s
        pending = self._pend(command.epoch, new, spec=None)
        source = self.ranks([command.source])[0]
        plan = state.transfer_plan(old, new, source=source)
        transfer_groups = state.create_transfer_groups(plan, worker=self.me, timeout_s=timeout_s)
        pending.transfers = [g for _, g in transfer_groups]
        return pending, pending.groups, transfer_groups

    def _prepare_sliced(self, command: PrepareResize, old: Layout, new: Layout) -> int:
        """A data-parallel resize with the distributed optimizer (see
        :func:`~dynarl.workers.megatron.resize.move_sliced`). Returns the bytes this
        worker sent."""
        pending, _, transfer_groups = self._begin_transfer(command, old, new)
        return resize.move_sliced(
            pending,
            transfer_groups,
            me=self.me,
            worker=self.worker,
            rank=self.rank,
            old=old,
            make_rank=self._empty,
            device=self.device,
        )

    def _prepare_reshard(self, command: PrepareReshard) -> Reply:
        """A change of tp or pp: the source replica gathers its state in the HF layout
        to its leader, which cuts each new member's shard (weights, moments, step) and
        sends it that shard alone (see
        :func:`~dynarl.workers.megatron.resize.move_through_leader`)."""
        started = time.perf_counter()
        if self.resizing is not None:
            raise TrainerError(f"resize {self.resizing.epoch} is still pending; abort it first")
        spec = dataclasses.replace(self.spec, tp=command.tp, pp=command.pp)
        spec.architecture()  # refuses a split the model cannot take, on every worker
        old = self.layout(command.old_members, self.spec)
        new = self.layout(command.new_members, spec)
        source = self.ranks([command.source])[0]
        pending = self._pend(command.epoch, new, spec=None if spec == self.spec else spec)
        moved = resize.move_through_leader(
            pending,
            me=self.me,
            rank=self.rank,
            old=old,
            source=source,
            make_rank=functools.partial(self._empty, spec=spec),
            device=self.device,
            timeout_s=self.config.reshard_timeout_s,
        )
        return self._done(started, bytes_moved=moved)

    def _commit(self, command: CommitResize) -> Reply:
        started = time.perf_counter()
        pending = self._prepared(command.epoch)
        self.rank = resize.commit(pending, self.rank, worker=self.worker, make_rank=self._empty)
        self.resizing = None
        if pending.spec is not None:
            self.spec = pending.spec
            self._hf = None
        return self._done(started)

    def _abort(self, command: AbortResize) -> Reply:
        started = time.perf_counter()
        if self.resizing is not None:
            self._prepared(command.epoch).release()
            self.resizing = None
        return self._done(started)

    def _save(self, command: SaveCheckpoint) -> Reply:
        started = time.perf_counter()
        rank = self._rank()
        full = state.gather_full_state(rank)
        if full is not None:
            state.write_checkpoint(full, command.path)
        return self._done(started)

    def _load(self, command: LoadCheckpoint) -> Reply:
        started = time.perf_counter()
        state.load_checkpoint(self._rank(), command.path)
        return self._done(started)

    def _describe(self, command: DescribeWeights) -> Reply:
        """The manifest of a sync: the HF model's parameters (names, dtypes, shapes)."""
        self._rank()
        manifest = manifest_of(
            self._hf_model(), version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        return WeightsDescribed(worker=self.worker, manifest=manifest)

    def _sync(self, command: SyncWeights) -> Reply:
        started = time.perf_counter()
        rank = self._rank()
        hf = state.gather_hf_weights(rank)
        if hf is None:  # a worker of replica 0 that is not its leader: it gave its shard
            return self._done(started)
        if self.sync_group is None:
            raise WeightSyncError(f"worker {self.worker} is not in a weight-sync group")
        model = self._hf_model()
        state.copy_into(model, hf)
        manifest = manifest_of(
            model, version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        sent = send_by_manifest(model, manifest, group=self.sync_group, staging=rank.staging)
        return self._done(started, bytes_moved=sent)

    def _hf_model(self) -> torch.nn.Module:
        """The HF-layout copy a sync sends from (built once, on the sender)."""
        if self._hf is None:
            self._hf = self.spec.hf_model(device=self.device)
        return self._hf

    # -- a lost peer (see recovery) --------------------------------------------------

    def detach_from_world(self) -> int:
        """Drop a prepared resize and keep the rank (its groups go with the world);
        returns its optimizer steps (``-1``: no rank)."""
        if self.resizing is not None:
            self.resizing.release(destroy=False)
            self.resizing = None
        return -1 if self.rank is None else self.rank.num_steps

    def _restore(self, command: Restore) -> Reply:
        """Build the survivors' layout in the new world; the holders' shards become
        the members' (see :func:`~dynarl.workers.megatron.recovery.restore`), or with
        the distributed optimizer the survivors' slices and buddy copies, made whole
        (:func:`~dynarl.workers.megatron.recovery.restore_sliced`)."""
        started = time.perf_counter()
        layout = self.layout(command.members, self.spec)
        groups = build_groups(layout, worker=self.me, timeout_s=self.config.timeout_s)
        if self.spec.distributed_optimizer:
            self.rank, moved = recovery.restore_sliced(
                self.rank,
                me=self.me,
                groups=groups,
                layout=layout,
                make_empty=lambda: self._empty(groups),
                timeout_s=self.config.timeout_s,
            )
            return self._done(started, bytes_moved=moved)
        holders = None
        if command.source is not None:
            holders = self.layout(command.holders or (command.source,), self.spec)
        self.rank, moved = recovery.restore(
            self.rank,
            me=self.me,
            groups=groups,
            layout=layout,
            holders=holders,
            make_empty=lambda: self._empty(groups),
            timeout_s=self.config.timeout_s,
            bucket_bytes=self.config.bucket_bytes,
        )
        return self._done(started, bytes_moved=moved)

    # -- helpers --------------------------------------------------------------------

    @property
    def me(self) -> int:
        """This worker's world rank (its pool index until a peer died)."""
        return self.ranks([self.worker])[0]

    def layout(self, members: Sequence[int], spec: ModelSpec) -> Layout:
        """The layout of pool workers ``members`` in world ranks (what its groups are
        built on): after a peer died the survivors' world ranks are not their pool
        indices."""
        return Layout(tuple(self.ranks(members)), spec.tp, spec.pp)

    def _pend(self, epoch: int, new: Layout, *, spec: ModelSpec | None) -> PreparedResize:
        """Build ``new``'s groups and make them the pending resize ``epoch``, unless
        this worker left the world meanwhile (an interrupted prepare: what it built
        belongs to the world it began in)."""
        generation = self.world.generation
        groups = build_groups(new, worker=self.me, timeout_s=self.config.reshard_timeout_s)
        with self.in_world(generation):
            self.resizing = PreparedResize(epoch=epoch, layout=new, groups=groups, spec=spec)
        return self.resizing

    def _empty(self, groups: RankGroups | None, spec: ModelSpec | None = None) -> MegatronRank:
        """A fresh rank of ``spec`` (default: this worker's) on ``groups`` (it receives a
        state)."""
        if groups is None:
            raise TrainerError(f"worker {self.worker} receives a shard but is not a member")
        return MegatronRank.empty(
            self.spec if spec is None else spec,
            loss_fn=self.loss_fn,
            config=self.config,
            groups=groups,
            device=self.device,
        )

    def _rank(self) -> MegatronRank:
        if self.rank is None:
            raise TrainerError(f"worker {self.worker} is not a trainer rank now")
        return self.rank

    def _prepared(self, epoch: int) -> PreparedResize:
        if self.resizing is None or self.resizing.epoch != epoch:
            have = None if self.resizing is None else self.resizing.epoch
            raise TrainerError(f"no prepared resize {epoch} on worker {self.worker} (have {have})")
        return self.resizing
