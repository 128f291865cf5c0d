"""A Megatron trainer that loses a worker: which layouts survive it, and a rank's part
of the rebuild.

The pool's recovery is the torch backend's (:mod:`~dynarl.workers.torch.trainer_recovery`:
the survivors leave the broken world, form a new one and restore one consistent state
from the survivor holding the most optimizer steps). What a Megatron worker adds is
its rank: on ``LeaveWorld`` it drops the layout's groups (they went with the world)
and keeps its :class:`~dynarl.workers.megatron.rank.MegatronRank`; on ``Restore`` it
builds the survivors' layout in the new world and :func:`restore` brings its rank to
the source's state.

That is only possible when every surviving member holds a whole copy of the state:
with ``tp = pp = 1`` (each worker a whole data-parallel replica) and torch's AdamW.
:func:`unrecoverable` names why any other layout is refused: a dead worker of a
``tp * pp`` replica takes the only copy of its shard of that replica with it, and the
distributed optimizer keeps each AdamW moment in one data-parallel rank alone.
"""

from collections.abc import Callable

import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron.layout import RankGroups
from dynarl.workers.megatron.rank import MegatronRank
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.torch import reshard


def unrecoverable(spec: ModelSpec) -> str | None:
    """Why a trainer of ``spec`` cannot survive a lost worker (``None``: it can)."""
    if spec.tp * spec.pp > 1:
        return (
            f"a Megatron trainer with tp={spec.tp}, pp={spec.pp} cannot survive a lost "
            "worker yet: the worker took its replica's only copy of its model shard (and "
            "AdamW moments) with it; only tp = pp = 1 rebuilds from the survivors"
        )
    if spec.distributed_optimizer:
        return (
            "a Megatron trainer with the distributed optimizer cannot survive a lost "
            "worker yet: each AdamW moment lives on one data-parallel rank alone, and the "
            "dead worker's slices went with it (actor.megatron.distributed_optimizer=false "
            "keeps a whole copy on every rank)"
        )
    return None


def restore(
    rank: MegatronRank | None,
    *,
    groups: RankGroups | None,
    source: int | None,
    make_empty: Callable[[RankGroups], MegatronRank],
    bucket_bytes: int,
) -> tuple[MegatronRank | None, int]:
    """This worker's part of a ``Restore`` in the new world, after it built the
    survivors' layout (``groups``; ``None`` when it is not a member): the member at
    world rank ``source`` sends its whole state over the data-parallel group, the
    other members receive it into a fresh rank (``make_empty``, see
    :meth:`MegatronRank.empty`), the source (and, without a source,
    every member: they hold one state) keeps its rank on the new groups; a worker that
    is not a member releases its rank. Returns the rank afterwards and the bytes sent."""
    if groups is None:
        if rank is not None:
            _release(rank)
        return None, 0
    if groups.layout.replica_size > 1:
        raise TrainerError(
            f"layout {groups.layout} has replicas of {groups.layout.replica_size} workers; "
            "a restore needs whole replicas of one worker"
        )
    me = groups.layout.members[groups.position.dp_rank]
    if source is None or source == me:
        if rank is None:
            raise TrainerError(f"world rank {me}, a member, holds no state to keep")
        rank.regroup(groups)
        if source is None:
            return rank, 0
        src = dist.get_group_rank(groups.dp, source)
        return rank, reshard.send_state(rank, group=groups.dp, src=src, bucket_bytes=bucket_bytes)
    if rank is not None:
        _release(rank)
    received = make_empty(groups)
    src = dist.get_group_rank(groups.dp, source)
    reshard.receive_state(received, group=groups.dp, src=src, bucket_bytes=bucket_bytes)
    return received, 0


def _release(rank: MegatronRank) -> None:
    rank.release()
    reshard.release_memory(rank)
