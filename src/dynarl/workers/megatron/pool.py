"""The driver side of the Megatron trainer: the torch backend's pool of pre-started
worker processes, with ranks that are replicas of ``tp * pp`` workers.

What changes from :class:`~dynarl.workers.torch.trainer_pool.TrainerPool`: members
come in whole replicas; the data router's instance of a data-parallel rank is its
replica's leader (the other workers of the replica take no items and receive the
leader's); a resize's source is a whole replica (the first that stays whole, else the
first); parking keeps replica 0; a checkpoint and a weight sync gather replica 0; a
lost worker is survived when a copy of each model shard survives it: the survivors
make whole replicas again (:mod:`~dynarl.workers.megatron.recovery`); with the
distributed optimizer when each dead rank's buddy survives, which keeps
a copy of its optimizer slice (:mod:`~dynarl.workers.megatron.buddy`).
"""

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import recovery
from dynarl.workers.megatron.layout import Layout
from dynarl.workers.torch.trainer_commands import (
    Done,
    Left,
    PrepareReshard,
    ReshardFault,
    SaveCheckpoint,
    TrainOnItems,
)
from dynarl.workers.torch.trainer_pool import TrainerPool
from dynarl.workers.torch.trainer_recovery import PlanRanks, RankPlan
from dynarl.workers.trainer import ResizeResult, StepMetrics


class MegatronPool(TrainerPool):
    """An elastic Megatron trainer over pre-started workers (see the module docstring).
    ``model_factory`` is the workers' :class:`~dynarl.workers.megatron.spec.ModelSpec`,
    whose ``tp`` and ``pp`` cut the members into replicas."""

    @property
    def replica_size(self) -> int:
        """Workers per data-parallel replica."""
        spec = self._model_factory
        return int(spec.tp) * int(spec.pp)

    def layout(self, members: Sequence[int] | None = None) -> Layout:
        """The layout of ``members`` (default: the current members)."""
        spec = self._model_factory
        return Layout(tuple(self._members if members is None else members), spec.tp, spec.pp)

    @property
    def rank_instances(self) -> list[str]:
        """Each replica leader's instance, in data-parallel order."""
        if self._parked or not self._members:
            return []
        return [self.workers[w].name for w in self.layout().leaders()]

    @property
    def cannot_recover(self) -> str | None:
        """Why a lost worker (the dead ones, once a call met them) cannot be survived in
        the current layout: with a copy of every model shard among the survivors (with
        the distributed optimizer: of every rank's optimizer slice, on the rank or its
        buddy) the pool rebuilds itself from them (see
        :mod:`~dynarl.workers.megatron.recovery`); otherwise (one replica of tp * pp > 1
        workers, every copy of a shard dead, a rank dead with its buddy) the run stops
        and resumes from its last checkpoint."""
        layout = self.layout() if self._members else None
        # Only the dead still in the world count: one already left behind (a spare that
        # died before a recovery, not admitted again) is not lost now.
        lost = [w for w in self.dead if w in self._world.indices]
        return recovery.unrecoverable(self._model_factory, layout, lost)

    def recovery_plan(self) -> PlanRanks | None:
        """With replicas of more than one worker, the survivors' layout and the holder
        of each shard (:func:`~dynarl.workers.megatron.recovery.plan`; with the
        distributed optimizer :func:`~dynarl.workers.megatron.recovery.plan_sliced`);
        else a torch pool's (every surviving member holds the whole state)."""
        if self.replica_size == 1:
            return None
        old = self.layout()
        parked = self._parked
        sliced = self._model_factory.distributed_optimizer

        def chosen(states: Mapping[int, Left], survivors: tuple[int, ...]) -> RankPlan:
            candidates = [w for w in survivors if not parked or w in old.members]
            steps = {w: s.num_steps for w, s in states.items()}
            if sliced:
                return recovery.plan_sliced(old, candidates, steps)
            return recovery.plan(old, candidates, steps)

        return chosen

    async def train_on_items(
        self, shards: Sequence[Sequence[str]], *, apply: bool = True
    ) -> StepMetrics | None:
        """One step: ``shards[r]`` are the items the router delivered to replica
        ``r``'s leader (without ``apply``, only completed)."""
        if self._parked:
            raise TrainerError("the trainer is parked (it holds no devices); resize it first")
        leaders = self.layout().leaders()
        if len(shards) != len(leaders):
            raise TrainerError(f"{len(shards)} shards for {len(leaders)} data-parallel ranks")
        items = {leader: tuple(shard) for leader, shard in zip(leaders, shards, strict=True)}
        replies = await self._world.call_each_checked(
            self._members, lambda w: TrainOnItems(item_ids=items.get(w, ()), apply=apply)
        )
        return self._stepped(replies) if apply else None

    async def resize(
        self,
        members: Sequence[int],
        *,
        source: int | None = None,
        fault: ReshardFault | None = None,
    ) -> ResizeResult:
        """Make ``members`` the ranks, create-before-destroy; the source is a whole
        replica of the current layout (named by its leader)."""
        new = self._valid_members(members)
        if source is None and self._members:
            replicas = self.layout().replicas()
            staying = [r for r in replicas if all(w in new for w in r)]
            source = (staying or replicas)[0][0]
        return await super().resize(new, source=source, fault=fault)

    async def reshard(self, members: Sequence[int], *, tp: int, pp: int) -> ResizeResult:
        """Make ``members`` the ranks with replicas of ``tp`` x ``pp`` workers (a change
        of tensor or pipeline parallel size), create-before-destroy: the first current
        replica gathers its state in the HF layout and every new member takes its
        shard. On failure every worker drops what it prepared, the old layout keeps
        training, and :class:`ReshardError` is raised."""
        spec = dataclasses.replace(self._model_factory, tp=tp, pp=pp)
        new = tuple(int(m) for m in members)
        Layout(new, tp, pp)  # whole replicas of the new size
        super()._valid_members(new)
        if self._parked or not self._members:
            raise TrainerError("reshard a running trainer (resize a parked one first)")
        old = self._members
        source = self.layout().replicas()[0][0]
        self._epoch += 1
        started = time.perf_counter()
        prepare = PrepareReshard(
            epoch=self._epoch, old_members=old, new_members=new, source=source, tp=tp, pp=pp
        )
        replies = await self._two_phase(
            prepare,
            f"reshard {old} -> {new} (tp={tp}, pp={pp}) failed and was rolled back; the old "
            "layout keeps training",
        )
        self._members = new
        self._model_factory = spec
        moved = sum(r.bytes_moved for r in replies if isinstance(r, Done))
        return ResizeResult(
            epoch=self._epoch,
            old_members=old,
            new_members=new,
            elapsed_s=time.perf_counter() - started,
            bytes_moved=moved,
        )

    async def park(self) -> ResizeResult:
        """Give up every device but replica 0's, which keeps the state."""
        if not self._members:
            raise TrainerError("the trainer has no members yet; call start_training first")
        keeper = self.layout().replicas()[0]
        result = await self.resize(keeper) if self._members != keeper else None
        self._parked = True
        return ResizeResult(
            epoch=self._epoch,
            old_members=() if result is None else result.old_members,
            new_members=(),
            elapsed_s=0.0 if result is None else result.elapsed_s,
            bytes_moved=0 if result is None else result.bytes_moved,
        )

    async def save_checkpoint(self, path: str | Path) -> None:
        """Replica 0 gathers its shards to its leader, which writes ``path`` (every
        member takes part: with the distributed optimizer each holds a slice of the
        moments)."""
        await self._world.call_checked(self._members, SaveCheckpoint(path=str(path)))

    async def sync_weights(self, version: int) -> int:
        """Replica 0 gathers the weights in the HF layout to its leader, which
        broadcasts them to the engines; returns the bytes sent."""
        replica = self.layout().replicas()[0]
        self.sender.checked(replica[:1])
        return await self.sender.send(replica, version)

    def _valid_members(self, members: Sequence[int]) -> tuple[int, ...]:
        chosen = super()._valid_members(members)
        if len(chosen) % self.replica_size:
            raise TrainerError(
                f"members {chosen}: the megatron trainer takes whole replicas of "
                f"actor.tp * actor.pp = {self.replica_size} workers"
            )
        return chosen
