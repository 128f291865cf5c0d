"""Where each trainer worker stands in a Megatron layout, and the process groups of it.

A layout is the trainer's members (world ranks) cut into data-parallel replicas of
``tp * pp`` consecutive workers; inside a replica the tensor-parallel rank varies
fastest (worker ``i`` of a replica is ``tp_rank = i % tp``, ``pp_rank = i // tp``).
The first worker of a replica is its *leader*: the data router delivers the replica's
samples there, and it shares them with the rest of its replica.

:func:`build_groups` creates every group of a layout with ``torch.distributed``
(collective over the world: every worker calls it with the same layout, members or
not) and returns this worker's: megatron-core's ``ProcessGroupCollection`` (tensor,
pipeline, data parallel), its replica (model-parallel) group, the group of all
members, and with more than one stage the *embedding group*: each pipeline's first and
last stage (a model with tied embeddings keeps a copy of the word embedding on the last
stage as its output layer, and the two copies' gradients are summed over it). The
groups are explicit, never ``parallel_state`` globals, so a resize builds the next
layout's beside the running one.
"""

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron.model import groups_of

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class Position:
    """A worker's coordinates in a layout."""

    dp_rank: int
    pp_rank: int
    tp_rank: int

    @property
    def model_rank(self) -> tuple[int, int]:
        """``(pp_rank, tp_rank)``: which shard of the model it holds."""
        return (self.pp_rank, self.tp_rank)


@dataclass(frozen=True)
class Layout:
    """Members cut into data-parallel replicas of ``tp * pp`` workers."""

    members: tuple[int, ...]
    tp: int
    pp: int

    def __post_init__(self) -> None:
        size = self.tp * self.pp
        if not self.members or len(self.members) % size:
            raise TrainerError(
                f"members {self.members} must be a positive multiple of tp * pp = {size} "
                f"workers (tp={self.tp}, pp={self.pp})"
            )

    @property
    def replica_size(self) -> int:
        """Workers per data-parallel replica."""
        return self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return len(self.members) // self.replica_size

    def replicas(self) -> list[tuple[int, ...]]:
        """Each replica's workers, in data-parallel order."""
        r = self.replica_size
        return [self.members[i : i + r] for i in range(0, len(self.members), r)]

    def leaders(self) -> tuple[int, ...]:
        """Each replica's first worker, in data-parallel order."""
        return tuple(replica[0] for replica in self.replicas())

    def position(self, worker: int) -> Position | None:
        """``worker``'s coordinates, or ``None`` when it is not a member."""
        if worker not in self.members:
            return None
        index = self.members.index(worker)
        dp_rank, inner = divmod(index, self.replica_size)
        pp_rank, tp_rank = divmod(inner, self.tp)
        return Position(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank)

    def at(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The worker at these coordinates."""
        return self.members[dp_rank * self.replica_size + pp_rank * self.tp + tp_rank]


@dataclass
class RankGroups:
    """One member's process groups in a layout."""

    layout: Layout
    position: Position
    collection: "ProcessGroupCollection"
    """Tensor, pipeline and data parallel groups, as megatron-core takes them."""
    replica: dist.ProcessGroup
    """The replica's workers (model parallel: tensor x pipeline)."""
    members: dist.ProcessGroup
    """Every member of the layout."""
    embedding: dist.ProcessGroup | None
    """This pipeline's first and last stage, on those two stages of a layout of more
    than one stage (``None`` elsewhere): the word embedding and a tied output layer."""
    created: list[dist.ProcessGroup]
    """Every group this worker is in (destroyed with the layout)."""

    @property
    def dp(self) -> dist.ProcessGroup:
        """Data-parallel group: the workers holding this worker's shard."""
        group: dist.ProcessGroup = self.collection.dp
        return group

    @property
    def leader(self) -> int:
        """This worker's replica leader (world rank)."""
        return self.layout.at(self.position.dp_rank, 0, 0)

    @property
    def is_loss_rank(self) -> bool:
        """Whether it reports its replica's loss (last stage, tensor rank 0)."""
        p = self.position
        return p.pp_rank == self.layout.pp - 1 and p.tp_rank == 0

    def destroy(self) -> None:
        """Destroy every group of this worker's layout."""
        for group in self.created:
            dist.destroy_process_group(group)
        self.created.clear()


def build_groups(layout: Layout, *, worker: int, timeout_s: float) -> RankGroups | None:
    """Create every group of ``layout`` (collective over the world, same order on every
    worker) and return ``worker``'s (``None`` when it is not a member)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mine: list[dist.ProcessGroup] = []

    def new(ranks: list[int]) -> dist.ProcessGroup | None:
        group: dist.ProcessGroup = dist.new_group(sorted(ranks), timeout=timeout)
        if worker in ranks:
            mine.append(group)
            return group
        return None

    at = layout.at
    found: dict[str, dist.ProcessGroup] = {}

    def keep(name: str, group: dist.ProcessGroup | None) -> None:
        if group is not None:
            found[name] = group

    keep("members", new(list(layout.members)))
    for d in range(layout.dp):
        keep("replica", new([at(d, p, t) for p in range(layout.pp) for t in range(layout.tp)]))
        for p in range(layout.pp):
            keep("tp", new([at(d, p, t) for t in range(layout.tp)]))
        for t in range(layout.tp):
            keep("pp", new([at(d, p, t) for p in range(layout.pp)]))
            if layout.pp > 1:
                keep("embedding", new([at(d, 0, t), at(d, layout.pp - 1, t)]))
    for p in range(layout.pp):
        for t in range(layout.tp):
            keep("dp", new([at(d, p, t) for d in range(layout.dp)]))
    # Context and expert parallel sizes are 1: their groups are a rank alone. Made here
    # like the others (named by torch's counter, destroyed with the layout): a group
    # made apart from the world, with a name hashed from its ranks and the number of
    # groups alive, can meet the name of one still alive once others are destroyed.
    for w in layout.members:
        keep("single", new([w]))
    position = layout.position(worker)
    if position is None:
        return None
    # torch orders a group's ranks by world rank; megatron reads a worker's tensor and
    # pipeline rank from its group, so the layout must keep world order inside them.
    if found["tp"].rank() != position.tp_rank or found["pp"].rank() != position.pp_rank:
        raise TrainerError(
            f"members {layout.members}: inside a replica the workers must come in "
            "increasing order (tensor ranks and pipeline stages follow world ranks)"
        )
    embedding = found.get("embedding")
    collection = groups_of(
        tp=found["tp"],
        pp=found["pp"],
        dp=found["dp"],
        mp=found["replica"],
        embd=embedding,
        single=found["single"],
    )
    # the distributed optimizer sums gradient statistics over every member
    collection.intra_dist_opt = found["members"]
    return RankGroups(
        layout=layout,
        position=position,
        collection=collection,
        replica=found["replica"],
        members=found["members"],
        embedding=embedding,
        created=mine,
    )
