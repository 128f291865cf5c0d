"""Resizing a Megatron layout on one worker, create-before-destroy: what the worker
prepares for a resize (:class:`PreparedResize`), how a member of the new layout gets
its shard, and the switch at commit (:func:`commit`).

The torch backend's :mod:`~dynarl.workers.torch.reshard` does this for ranks that
each hold the whole model; here a rank holds one shard of a layout of replicas
(:mod:`~dynarl.workers.megatron.layout`), and a new member gets its shard in one of
three ways:

- the plan's moves (:func:`~dynarl.workers.megatron.state.run_moves`), a resize of
  the data-parallel size: each shard a worker lacks comes whole (parameters, AdamW
  moments and step) from the same shard of a source replica;
- :func:`move_sliced`, the same with Megatron's distributed optimizer, whose AdamW
  state is sliced over the data-parallel group: the old members make each shard's
  moments whole first, and every new member keeps its own slices;
- :func:`move_through_leader`, a change of tp or pp: the source replica gathers its
  state in the HF layout to its leader, which cuts each new member's shard.

The layouts here are layouts of world ranks. Nothing switches before :func:`commit`;
an abort releases what was prepared (:meth:`PreparedResize.release`).
"""

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dynarl.workers.errors import ReshardError
from dynarl.workers.megatron import state
from dynarl.workers.megatron.layout import Layout, RankGroups
from dynarl.workers.megatron.rank import MegatronRank
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.torch import reshard

MakeRank = Callable[[RankGroups], MegatronRank]
"""Builds an empty rank on the new layout's groups (it receives a state)."""


@dataclass
class PreparedResize:
    """What a worker prepared for one resize: the new layout, its groups (``None``
    where this worker is not a member), the transfer groups and the rank that
    received this worker's new state."""

    epoch: int
    layout: Layout
    groups: RankGroups | None
    transfers: list[dist.ProcessGroup] = field(default_factory=list)
    received: MegatronRank | None = None
    spec: ModelSpec | None = None
    """The spec after a change of tp or pp (``None``: unchanged)."""

    def release(self, *, destroy: bool = True) -> None:
        """Release what was prepared (the groups too, unless they went with the
        world: ``destroy`` false)."""
        for group in self.transfers if destroy else ():
            dist.destroy_process_group(group)
        self.transfers.clear()
        if self.groups is not None and destroy:
            self.groups.destroy()
        if self.received is not None:
            self.received.release()
            reshard.release_memory(self.received)
            self.received = None


def move_sliced(
    prepared: PreparedResize,
    transfer_groups: Sequence[tuple[state.Move, dist.ProcessGroup]],
    *,
    me: int,
    worker: int,
    rank: MegatronRank | None,
    old: Layout,
    make_rank: MakeRank,
    device: torch.device,
) -> int:
    """World rank ``me``'s (pool worker ``worker``'s) part of a data-parallel resize
    ``old -> prepared.layout`` with the distributed optimizer, whose slices depend on
    the data-parallel size: every old member makes its shard's moments whole (one sum
    over the old data-parallel group), the plan's moves (``transfer_groups``) send each
    shard whole from the source replica to the workers of the new layout that lack it,
    and every new member builds a new rank (``make_rank``, kept as
    ``prepared.received``) that keeps its slices of its shard (received, or its own
    when it keeps its position). Returns the bytes this worker sent."""
    new = prepared.layout
    mine = state.local_cut(rank) if rank is not None else None
    before, after = old.position(me), new.position(me)
    kept = before is not None and after is not None and before.model_rank == after.model_rank
    own = mine if kept else None
    moved = 0
    for move, group in transfer_groups:
        if me == move.source:
            assert mine is not None
            state.share_batch(mine, group=group, src=move.source, device=device)
            moved += state.nbytes(mine)
        else:
            own = state.share_batch(None, group=group, src=move.source, device=device)
    if prepared.groups is not None:
        if own is None:
            raise ReshardError(f"worker {worker} got no state in the resize")
        receiver = make_rank(prepared.groups)
        state.load_cut(receiver, own, source="the resize's source replica")
        prepared.received = receiver
    return moved


def move_through_leader(
    prepared: PreparedResize,
    *,
    me: int,
    rank: MegatronRank | None,
    old: Layout,
    source: int,
    make_rank: MakeRank,
    device: torch.device,
    timeout_s: float,
) -> int:
    """World rank ``me``'s part of a resize ``old -> prepared.layout`` that changes tp
    or pp: the replica of ``source`` (a world rank) gathers the full state in the HF
    layout to its leader, which cuts every new member's shard (weights, moments, step)
    and sends it that alone; each new member builds a new rank of the new spec
    (``make_rank``, kept as ``prepared.received``) holding it. Returns the bytes this
    worker sent."""
    new = prepared.layout
    where = old.position(source)
    if where is None:
        raise ReshardError(f"source worker {source} is not a member")
    leader = old.replicas()[where.dp_rank][0]
    # One pair group per new member: the leader cuts each member's shard out of
    # the gathered state and sends it that shard only.
    pairs: dict[int, dist.ProcessGroup] = {}
    timeout = datetime.timedelta(seconds=timeout_s)
    for member in new.members:
        if member != leader:
            group = dist.new_group(sorted([leader, member]), timeout=timeout)
            if me in (leader, member):
                pairs[member] = group
    prepared.transfers.extend(pairs.values())
    full = None
    if rank is not None:  # every old member (the distributed optimizer's slices)
        full = state.gather_full_state(rank, dp_rank=where.dp_rank)
    moved = 0
    own: dict[str, torch.Tensor] | None = None
    if full is not None:  # the leader
        assert rank is not None
        for member in new.members:
            p = new.position(member)
            assert p is not None
            cut = state.cut_state(
                full, rank.arch, tp_rank=p.tp_rank, tp=new.tp, pp_rank=p.pp_rank, pp=new.pp
            )
            if member == leader:
                own = cut
                continue
            state.share_batch(cut, group=pairs[member], src=leader, device=device)
            moved += state.nbytes(cut)
    elif prepared.groups is not None:
        own = state.share_batch(None, group=pairs[me], src=leader, device=device)
    if prepared.groups is not None:
        assert own is not None
        receiver = make_rank(prepared.groups)
        state.load_cut(receiver, own, source=f"worker {leader}")
        prepared.received = receiver
    return moved


def commit(
    prepared: PreparedResize, rank: MegatronRank | None, *, worker: int, make_rank: MakeRank
) -> MegatronRank | None:
    """Switch pool worker ``worker`` from ``rank`` (``None``: it has none) to the
    prepared layout; returns its rank there (``None``: not a member). A member keeps
    the state it received, else its own ``rank`` on the new groups
    (:func:`~dynarl.workers.megatron.state.regrouped`, ``make_rank`` building a fresh
    rank for it); the old groups are destroyed and a rank not kept is released."""
    for group in prepared.transfers:
        dist.destroy_process_group(group)
    old_groups = rank.groups if rank is not None else None
    kept: MegatronRank | None = None
    groups = prepared.groups
    if groups is not None:
        kept = prepared.received if prepared.received is not None else rank
        if kept is None:
            raise ReshardError(f"worker {worker} has no state after the resize")
        if kept is rank:
            kept = state.regrouped(rank, groups, lambda: make_rank(groups))
    if old_groups is not None:
        old_groups.destroy()
    if rank is not None and kept is not rank:
        rank.release()
        reshard.release_memory(rank)
    return kept
