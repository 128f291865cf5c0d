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

With Megatron's distributed optimizer each data-parallel rank holds only its slice of
AdamW's state, and its buddy (the next rank) a copy of it
(:mod:`~dynarl.workers.megatron.buddy`): :func:`restore_sliced` makes each shard's
state whole from the survivors' slices and copies at the last step count a survivor
completed, and every member of the survivors' layout keeps its slices of it, as a
resize does.

:func:`unrecoverable` names why the others stop: with one data-parallel replica, or
when every copy of a shard died, a shard of the model (and its moments) has no copy
left; with the distributed optimizer, when a rank and its buddy died together. With
the distributed optimizer and tp or pp > 1, :func:`plan_sliced` picks the survivors'
whole replicas.
"""

import datetime
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import buddy, state
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
    if layout is None:
        return None
    if spec.distributed_optimizer and layout.dp > 1:  # with one, the slice is whole
        if not spec.buddy_copies:
            return _uncopied(layout, lost)
        return _unrecoverable_sliced(layout, lost)
    if layout.replica_size == 1:
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


def _unrecoverable_sliced(layout: Layout, lost: Collection[int]) -> str | None:
    """:func:`unrecoverable` with the distributed optimizer and two data-parallel ranks
    or more: each rank's slice survives on the rank or on its buddy
    (:mod:`~dynarl.workers.megatron.buddy`). A shard whose every copy died took each of
    its ranks with its buddy, so that loss is refused here too."""
    at, dp = layout.at, layout.dp
    dead = [
        (p, t, d)
        for p in range(layout.pp)
        for t in range(layout.tp)
        for d in range(dp)
        if at(d, p, t) in lost and at((d + 1) % dp, p, t) in lost
    ]
    if not dead:
        return None
    if layout.replica_size == 1:
        which = f"data-parallel rank(s) {[d for *_, d in dead]} died with their buddies "
        which += f"{[(d + 1) % dp for *_, d in dead]}"
    else:
        which = f"the data-parallel ranks of slice(s) {dead} (pp_rank, tp_rank, dp_rank) "
        which += "died with their buddies"
    return (
        f"a Megatron trainer with the distributed optimizer cannot survive losing "
        f"workers {sorted(lost)}: {which} (the next rank, which keeps a copy of each "
        "rank's AdamW slice), so those slices have no copy left; resume from the last "
        "checkpoint, or with actor.megatron.distributed_optimizer=false every rank keeps "
        "the whole moments of its shard"
    )


def _uncopied(layout: Layout, lost: Collection[int]) -> str | None:
    """:func:`unrecoverable` with the distributed optimizer and no buddy copies: every
    member's slice lives on it alone (a spare's loss changes nothing)."""
    if lost and not set(lost) & set(layout.members):
        return None
    return (
        "a Megatron trainer with the distributed optimizer and "
        "actor.megatron.buddy_copies=false cannot survive a lost rank: each data-parallel "
        "rank alone holds its slice of the AdamW state; resume from the last checkpoint, "
        "or set actor.megatron.buddy_copies=true (a copy of each slice on the next rank)"
    )


def plan_sliced(old: Layout, candidates: Sequence[int], steps: Mapping[int, int]) -> RankPlan:
    """The layout after a loss with the distributed optimizer (see :func:`plan` for the
    arguments): as many whole replicas of ``candidates`` as they make, in world order
    (every member builds a new rank from the slices, so none is better placed), and as
    source the survivor holding the most steps (the state restored). Raises
    :class:`TrainerError` when no survivor holds a state or too few survive."""
    holding = [w for w in candidates if steps.get(w, -1) >= 0]
    if not holding:
        raise TrainerError(f"no survivor of layout {old} holds the trainer's state")
    num_members = len(candidates) // old.replica_size * old.replica_size
    if not num_members:
        raise TrainerError(
            f"{len(candidates)} survivors cannot make a replica of {old.replica_size}"
        )
    source = max(holding, key=lambda w: steps[w])
    return RankPlan(members=tuple(candidates[:num_members]), source=source)


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


def restore_sliced(
    rank: MegatronRank | None,
    *,
    me: int,
    groups: RankGroups | None,
    layout: Layout,
    make_empty: Callable[[], MegatronRank],
    timeout_s: float,
) -> tuple[MegatronRank | None, int]:
    """World rank ``me``'s part of a ``Restore`` with the distributed optimizer, after
    it built ``layout``'s groups (``groups``; ``None``: not a member): the survivors'
    slices are made whole per shard and every member builds a new rank of its shard
    (see the module); the old rank is released. Collective over the world. Returns
    the new rank and the bytes this worker contributed."""
    mine, held = _offer(rank, me=me)
    offers: list[buddy.Offer | None] = [None] * dist.get_world_size()
    dist.all_gather_object(offers, mine)
    found = [o for o in offers if o is not None]
    target, chosen = buddy.choose(found, tp=layout.tp, pp=layout.pp)
    fresh = make_empty() if groups is not None else None
    new_shard = None if groups is None else groups.position.model_rank
    holder = fresh if fresh is not None else rank
    device = torch.device("cpu") if holder is None else holder.device
    timeout = datetime.timedelta(seconds=timeout_s)
    cut: dict[str, torch.Tensor] | None = None
    sent = 0
    created = []
    try:
        for shard in [(p, t) for p in range(layout.pp) for t in range(layout.tp)]:
            givers = {w for (s, _), (w, _) in chosen.items() if s == shard}
            takers = {w for w in layout.members if _shard(layout, w) == shard}
            ranks = sorted(givers | takers)
            group = dist.new_group(ranks, timeout=timeout)
            if me not in ranks:
                continue
            created.append(group)
            given = [
                _find(held, kind, d, target)
                for (s, d), (w, kind) in chosen.items()
                if s == shard and w == me
            ]
            sent += sum(s.data.numel() * 4 for s in given)
            into = fresh if shard == new_shard and fresh is not None else rank
            assert into is not None
            whole = _assemble(into, given, group=group, device=device)
            if shard == new_shard:
                cut = _cut(into, whole, num_steps=target)
    finally:
        for group in created:
            dist.destroy_process_group(group)
    if fresh is not None:
        assert cut is not None
        state.load_cut(fresh, cut, source="the survivors' slices and buddy copies")
    if rank is not None:
        _release(rank)
    return fresh, sent


def _find(
    held: Mapping[str, list[buddy.Slice]], kind: str, dp_rank: int, num_steps: int
) -> buddy.Slice:
    for s in held[kind]:
        if (s.dp_rank, s.num_steps) == (dp_rank, num_steps):
            return s
    raise AssertionError(f"no {kind} slice {dp_rank} at step {num_steps}")


def _assemble(
    rank: MegatronRank,
    given: Sequence[buddy.Slice],
    *,
    group: dist.ProcessGroup,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The shard's whole tensors (``exp_avg``, ``exp_avg_sq``, ``main``, flattened) and
    ``[adam_step, has_moments]`` under ``meta``, summed over ``group`` from the slices
    each worker gives (the giver of slice 0 adds the meta)."""
    total = sum(p.numel() for p in rank.model.parameters())
    flat = torch.zeros(len(buddy.KEYS) * total + 2, dtype=torch.float32, device=device)
    for piece in given:
        where = piece.indices().to(device)
        if len(where) and int(where.max()) >= total:
            raise TrainerError(f"a slice of {int(where.max()) + 1} elements for a shard of {total}")
        n = piece.length
        for k in range(len(buddy.KEYS)):
            flat[k * total + where] = piece.data[k * n : (k + 1) * n].to(device)
        if piece.dp_rank == 0:
            flat[-2], flat[-1] = piece.adam_step, float(piece.has_moments)
    dist.all_reduce(flat, group=group)
    out = {key: flat[k * total : (k + 1) * total] for k, key in enumerate(buddy.KEYS)}
    out["meta"] = flat[-2:]
    return out


def _cut(
    rank: MegatronRank, whole: Mapping[str, torch.Tensor], *, num_steps: int
) -> dict[str, torch.Tensor]:
    """The whole shard state as :func:`~dynarl.workers.megatron.state.cut_state` gives
    it: the weights (the main parameters in the model's dtypes), the moments if any,
    ``main`` for a model not in fp32, the step counts."""
    adam_step, has_moments = float(whole["meta"][0]), bool(whole["meta"][1])
    cut = {
        "step": torch.tensor(adam_step, dtype=torch.float64),
        "num_steps": torch.tensor(num_steps, dtype=torch.int64),
    }
    params = list(rank.model.named_parameters())
    keys = ["main"] if params[0][1].dtype != torch.float32 else []
    if has_moments:
        keys += ["exp_avg", "exp_avg_sq"]
    offset = 0
    for name, param in params:
        n = param.numel()
        main = whole["main"][offset : offset + n].view(param.shape)
        cut[f"model/{name}"] = main.to(param.dtype)
        for key in keys:
            cut[f"{key}/{name}"] = whole[key][offset : offset + n].view(param.shape)
        offset += n
    return cut


def _shard(layout: Layout, worker: int) -> Shard:
    position = layout.position(worker)
    assert position is not None
    return position.model_rank


def _shards(layout: Layout) -> list[Shard]:
    return [(p, t) for p in range(layout.pp) for t in range(layout.tp)]


def _release(rank: MegatronRank) -> None:
    rank.release()
    reshard.release_memory(rank)


def _offer(
    rank: MegatronRank | None, *, me: int
) -> tuple[buddy.Offer | None, dict[str, list[buddy.Slice]]]:
    """What world rank ``me`` holds of the old layout (``None``: no rank), and its
    slices by kind. A data-parallel group of one keeps no copies: its slice is the
    rank's live state, taken at its step count."""
    if rank is None or rank.distributed is None:
        return None, {}
    adam = rank.distributed
    position = rank.groups.position
    mine = list(adam.copies.mine) or [adam.snapshot(rank.num_steps)]
    held = {"own": mine, "theirs": list(adam.copies.theirs)}
    found = buddy.Offer(
        worker=me,
        shard=position.model_rank,
        dp=rank.groups.layout.dp,
        num_steps=rank.num_steps,
        own=tuple((s.dp_rank, s.num_steps) for s in mine),
        theirs=tuple((s.dp_rank, s.num_steps) for s in held["theirs"]),
    )
    return found, held
