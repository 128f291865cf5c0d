"""A Megatron trainer that loses a worker: which layouts survive it, the survivors'
new layout, and a rank's part of the rebuild.

The pool's recovery is the torch backend's (:mod:`~dynarl.workers.torch.trainer_recovery`:
the survivors leave the broken world, form a new one and restore one consistent state).
What a Megatron worker adds is its rank: on ``LeaveWorld`` it drops the layout's groups
(they went with the world) and keeps its :class:`~dynarl.workers.megatron.rank.MegatronRank`;
on ``Restore`` it builds the survivors' layout in the new world and :func:`restore`
brings its rank to the restored state.

A replica of ``tp * pp`` workers holds one shard of the model per worker; the dead
worker's replica is incomplete, but with two or more data-parallel replicas each of
its shards has other copies. :func:`plan` chooses the survivors' layout (the same tp
and pp, as many whole replicas as the survivors make; the rest are held as workers
without a rank) and, for each shard, a survivor holding it at the last step count
every shard reached (the *holders*, possibly of different replicas: every replica
holds the same state after a step). :func:`restore` moves the shards with the
resize's transfer plan (:func:`~dynarl.workers.megatron.state.transfer_plan`) from the
holders, read as one replica, onto the new layout: a holder that keeps its position
keeps its rank, every other member receives its shard whole (parameters, AdamW moments
and step). With ``tp = pp = 1`` every surviving member holds the whole state and
continues (the torch pool's plan).

:func:`unrecoverable` names why the others stop: with one data-parallel replica, or
when every copy of a shard died, a shard of the model (and its moments) has no copy
left; and the distributed optimizer keeps each AdamW moment's slice on one data-
parallel rank alone, so the dead rank's slices went with it.
"""

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence

import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import state
from dynarl.workers.megatron.layout import Layout, RankGroups
from dynarl.workers.megatron.rank import MegatronRank
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.torch import reshard
from dynarl.workers.torch.trainer_recovery import RankPlan

Shard = tuple[int, int]
"""``(pp_rank, tp_rank)``."""


def unrecoverable(spec: ModelSpec, layout: Layout | None, lost: Collection[int]) -> str | None:
    """Why a trainer of ``spec`` in ``layout`` (``None``: no ranks yet) cannot survive
    losing the workers ``lost`` (empty: any one worker); ``None``: it can."""
    if spec.distributed_optimizer:
        return (
            "a Megatron trainer with the distributed optimizer cannot survive a lost "
            "worker: each AdamW moment's slice lives on one data-parallel rank alone, and "
            "the dead worker's slices went with it (actor.megatron.distributed_optimizer="
            "false keeps a whole copy on every rank)"
        )
    if layout is None or layout.replica_size == 1:
        return None
    gone = missing(layout, [w for w in layout.members if w not in lost])
    if layout.dp == 1 and (gone or not lost):
        return (
            f"a Megatron trainer with tp={spec.tp}, pp={spec.pp} cannot survive a lost "
            "worker with one data-parallel replica: the worker took the only copy of its "
            "model shard (and AdamW moments) with it; with two replicas or more another "
            "holds it"
        )
    if gone:
        return (
            f"a Megatron trainer with tp={spec.tp}, pp={spec.pp} cannot survive losing "
            f"workers {sorted(lost)}: every copy of model shard(s) {gone} (pp_rank, "
            "tp_rank) died with them"
        )
    return None


def missing(layout: Layout, holding: Collection[int]) -> list[Shard]:
    """The shards of ``layout`` that none of the workers ``holding`` holds."""
    held = {_shard(layout, w) for w in holding if w in layout.members}
    return [s for s in _shards(layout) if s not in held]


def plan(old: Layout, candidates: Sequence[int], steps: Mapping[int, int]) -> RankPlan:
    """The layout after a loss: ``old``'s ranks held ``steps`` optimizer steps each
    (by worker; a dead worker is absent, ``-1``: no state); ``candidates`` are the
    survivors that may become ranks, in world order. Picks the most steps that a
    survivor of every shard holds, as many whole replicas of ``candidates`` as they
    make (in world order, so tensor ranks and stages follow world ranks), holding out
    the ones that leave the most holders in their positions (nothing moves for them;
    of equals, the last in world order are held), and a holder of each shard. Raises
    :class:`TrainerError` if a shard has no copy left at one step count."""
    holders: dict[Shard, list[int]] = {}
    for w in old.members:
        if steps.get(w, -1) >= 0:
            holders.setdefault(_shard(old, w), []).append(w)
    gone = [s for s in _shards(old) if s not in holders]
    if gone:
        raise TrainerError(
            f"every copy of model shard(s) {gone} (pp_rank, tp_rank) of layout {old} died"
        )
    counts = sorted({steps[w] for ws in holders.values() for w in ws}, reverse=True)
    at = [n for n in counts if all(any(steps[w] == n for w in ws) for ws in holders.values())]
    if not at:
        found = {s: [steps[w] for w in ws] for s, ws in holders.items()}
        raise TrainerError(f"the surviving shards hold no common step count: {found}")
    fresh = {w for ws in holders.values() for w in ws if steps[w] == at[0]}
    size = old.replica_size
    num_members = len(candidates) // size * size
    if not num_members:
        raise TrainerError(f"{len(candidates)} survivors cannot make a replica of {size}")

    def kept(members: tuple[int, ...]) -> list[int]:
        new = Layout(members, old.tp, old.pp)
        return [w for w in members if w in fresh and _shard(new, w) == _shard(old, w)]

    held = list(itertools.combinations(candidates, len(candidates) - num_members))
    choices = [tuple(w for w in candidates if w not in out) for out in reversed(held)]
    members = max(choices, key=lambda m: len(kept(m)))  # of the best, the one holding the last
    staying = kept(members)
    chosen = []
    for shard in _shards(old):
        stays = [w for w in staying if _shard(old, w) == shard]
        chosen.append((stays or [w for w in holders[shard] if w in fresh])[0])
    return RankPlan(members=members, source=chosen[0], holders=tuple(chosen))


def restore(
    rank: MegatronRank | None,
    *,
    me: int,
    groups: RankGroups | None,
    layout: Layout,
    holders: Layout | None,
    make_empty: Callable[[], MegatronRank],
    timeout_s: float,
    bucket_bytes: int,
) -> tuple[MegatronRank | None, int]:
    """This worker's (world rank ``me``) part of a ``Restore`` in the new world, after
    it built ``layout``'s groups (``groups``; ``None`` when it is not a member):
    ``holders`` (one replica of world ranks, ``None``: the members already hold one
    state, nothing moves) send their shards to the members that lack them (see the
    module); a member keeping its shard keeps its rank on the new groups, a worker
    without a rank afterwards releases its state. Returns the rank afterwards and the
    bytes sent."""
    if holders is None:
        if groups is not None and rank is None:
            raise TrainerError(f"world rank {me}, a member, holds no state to keep")
        return _keep(rank, groups, make_empty), 0
    where = holders.position(me)
    if where is not None and (rank is None or rank.groups.position.model_rank != where.model_rank):
        have = None if rank is None else rank.groups.position.model_rank
        raise TrainerError(
            f"world rank {me} is to send model shard {where.model_rank} but holds {have}"
        )
    plan_ = state.transfer_plan(holders, layout, source=holders.members[0])
    transfers = state.create_transfer_groups(plan_, worker=me, timeout_s=timeout_s)
    try:
        moved = state.run_moves(
            transfers, worker=me, rank=rank, make_empty=make_empty, bucket_bytes=bucket_bytes
        )
    finally:
        for _, group in transfers:
            dist.destroy_process_group(group)
    if moved.received is not None:
        if rank is not None:
            _release(rank)
        return moved.received, moved.sent_bytes
    if groups is not None and rank is None:
        raise TrainerError(f"world rank {me}, a member, received no state")
    return _keep(rank, groups, make_empty), moved.sent_bytes


def _keep(
    rank: MegatronRank | None, groups: RankGroups | None, make_empty: Callable[[], MegatronRank]
) -> MegatronRank | None:
    """``rank`` on ``groups``, or released when this worker is no member."""
    if rank is None:
        return None
    kept = None if groups is None else state.regrouped(rank, groups, make_empty)
    if kept is not rank:
        _release(rank)
    return kept


def _shard(layout: Layout, worker: int) -> Shard:
    position = layout.position(worker)
    assert position is not None
    return position.model_rank


def _shards(layout: Layout) -> list[Shard]:
    return [(p, t) for p in range(layout.pp) for t in range(layout.tp)]


def _release(rank: MegatronRank) -> None:
    rank.release()
    reshard.release_memory(rank)
