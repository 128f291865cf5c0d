"""Buddy copies of the distributed optimizer's slices: each data-parallel rank's AdamW
state kept by its ring neighbour, so the survivors of a lost rank rebuild the whole
moments without a checkpoint.

With Megatron's distributed optimizer each data-parallel rank alone holds its slice of
AdamW's moments (and, for bf16 parameters, of the fp32 main parameters): a dead rank
would take its slice with it. At every optimizer-step boundary each rank therefore
packs its slice (moments, main parameters, step counts; a :class:`Slice`, in host
memory), sends it to its *buddy*, the next rank of its data-parallel group
(``dp_rank + 1 mod dp``), and receives its predecessor's (:func:`swap`). Then one
all-reduce over the layout's members *commits* the boundary (:func:`commit`): until it
completes a rank keeps the previous boundary's slices too. Whenever a peer dies, either
some rank completed the commit, and then every rank had swapped: the new boundary is
held whole; or none did, and every rank still holds the previous one. Every member
takes part (not only the data-parallel group), so that the shards of a model cut by tp
or pp agree on the boundary.

A rank whose step fails after its optimizer updated its slice (a peer died in the
parameter all-gather or in the swap) rolls its slice back to its own copy of the last
boundary (:meth:`~dynarl.workers.megatron.optim.DistributedAdam.roll_back`); one that
fails in the commit keeps both boundaries' slices. Its step count never counts a
failed step.

After a loss the survivors say which slices they hold at which step count
(:func:`offer`: their own, their predecessor's copy), and :func:`choose` picks, for
each slice of each model shard, a survivor holding it at the most steps any survivor
completed (the step count the pool reports); the recovery
(:mod:`~dynarl.workers.megatron.recovery`) makes them whole and re-slices them on the
survivors' layout. A rank and its buddy dying together lose that rank's slice:
:func:`choose` refuses and says why.

Cost: between steps each rank holds two slices in host memory (its own, to roll back
to, and its predecessor's), ``3 / dp`` of a shard's parameters in fp32 each (two
moments and the main parameters); up to four while a boundary is being committed. Each
step sends one slice to the buddy and receives one.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError

Shard = tuple[int, int]
"""``(pp_rank, tp_rank)``."""

KEYS = ("exp_avg", "exp_avg_sq", "main")
"""The blocks of a slice's data, in order (``main``: the main parameters, which are the
model's own for fp32 parameters)."""


@dataclass(frozen=True)
class Slice:
    """One data-parallel rank's slice of its model shard's optimizer state at a step
    boundary, in host memory."""

    dp_rank: int
    num_steps: int
    """The rank's optimizer steps at the boundary."""
    adam_step: float
    """AdamW's step count (the bias correction's)."""
    has_moments: bool
    """Whether AdamW holds moments yet (none before the first step)."""
    segments: torch.Tensor
    """``(offset, length)`` rows (int64): where the slice's elements lie in the shard's
    parameters flattened one after the other in ``named_parameters`` order."""
    data: torch.Tensor
    """fp32: the slice's ``exp_avg`` elements, then ``exp_avg_sq``'s, then ``main``'s."""

    @property
    def length(self) -> int:
        """Elements of the slice (per key)."""
        return int(self.segments[:, 1].sum()) if len(self.segments) else 0

    def indices(self) -> torch.Tensor:
        """The slice's element indices in the flattened shard."""
        if not len(self.segments):
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(int(o), int(o) + int(n)) for o, n in self.segments])


@dataclass
class Copies:
    """What one rank keeps: its own slice at the last boundaries (to roll back to) and
    its predecessor's (the buddy copy), oldest first; one of each once a boundary is
    committed, two while it is not."""

    mine: list[Slice] = field(default_factory=list)
    theirs: list[Slice] = field(default_factory=list)

    def add(self, mine: Slice, theirs: Slice) -> None:
        """A boundary's slices, not yet committed."""
        self.mine.append(mine)
        self.theirs.append(theirs)

    def settle(self) -> None:
        """The last boundary is committed: drop the older ones."""
        del self.mine[:-1], self.theirs[:-1]

    def held(self) -> list[tuple[str, Slice]]:
        """Every slice kept, as ``("own" | "theirs", slice)``."""
        return [("own", s) for s in self.mine] + [("theirs", s) for s in self.theirs]

    @property
    def nbytes(self) -> int:
        """Host memory the copies take."""
        return sum(s.data.numel() * 4 + s.segments.numel() * 8 for _, s in self.held())


def swap(mine: Slice, *, group: dist.ProcessGroup, device: torch.device) -> Slice:
    """Send ``mine`` to the next rank of the data-parallel ``group`` and receive the
    previous rank's (into fresh buffers: a swap that fails midway leaves the kept
    copies whole). Collective over ``group``."""
    me, size = group.rank(), group.size()
    after, before = (me + 1) % size, (me - 1) % size
    header = torch.tensor(
        [mine.num_steps, mine.adam_step, float(mine.has_moments), mine.dp_rank, len(mine.segments)],
        dtype=torch.float64,
        device=device,
    )
    got = torch.empty_like(header)
    _exchange(header, got, group=group, after=after, before=before)
    segments = torch.empty((int(got[4]), 2), dtype=torch.int64, device=device)
    _exchange(mine.segments.to(device), segments, group=group, after=after, before=before)
    length = int(segments[:, 1].sum()) if len(segments) else 0
    data = torch.empty(len(KEYS) * length, dtype=torch.float32, device=device)
    _exchange(mine.data.to(device), data, group=group, after=after, before=before)
    return Slice(
        dp_rank=int(got[3]),
        num_steps=int(got[0]),
        adam_step=float(got[1]),
        has_moments=bool(got[2]),
        segments=segments.cpu(),
        data=data.cpu(),
    )


def _exchange(
    out: torch.Tensor, into: torch.Tensor, *, group: dist.ProcessGroup, after: int, before: int
) -> None:
    if not out.numel() and not into.numel():
        return
    sent = dist.isend(out.contiguous(), group=group, group_dst=after)
    received = dist.irecv(into, group=group, group_src=before)
    for work in (sent, received):
        if work is not None:
            work.wait()


def commit(*, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of ``group`` (the layout's members) holds the new boundary's slices
    (see the module): one all-reduce. Collective over ``group``."""
    dist.all_reduce(torch.ones(1, device=device), group=group)


# -- rebuilding after a loss ----------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """What one survivor holds of the old layout's optimizer state: its shard, the data-
    parallel size, its rank's step count, and its slices as ``(dp_rank, num_steps)``
    (its own, and its predecessor's copies)."""

    worker: int
    """World rank in the new world."""
    shard: Shard
    dp: int
    num_steps: int
    own: tuple[tuple[int, int], ...]
    theirs: tuple[tuple[int, int], ...]


Chosen = dict[tuple[Shard, int], tuple[int, str]]
"""For each ``(shard, dp_rank)`` slice, the survivor (world rank) that gives it and
whether from its own slices or its copies (``"own"`` | ``"theirs"``)."""


def choose(offers: Sequence[Offer], *, tp: int, pp: int) -> tuple[int, Chosen]:
    """The step count to restore (the most any survivor completed) and who gives each
    slice of it (a survivor's own before its buddy's copy). Raises
    :class:`TrainerError` naming the slices no survivor holds at that step."""
    if not offers:
        raise TrainerError("no surviving worker holds the trainer's state")
    sizes = {o.dp for o in offers}
    if len(sizes) != 1:
        raise TrainerError(f"the survivors held ranks of different layouts (dp {sorted(sizes)})")
    (dp,) = sizes
    target = max(o.num_steps for o in offers)
    chosen: Chosen = {}
    missing = []
    for shard in [(p, t) for p in range(pp) for t in range(tp)]:
        for d in range(dp):
            found = [(o.worker, "own") for o in offers if o.shard == shard and (d, target) in o.own]
            found += [
                (o.worker, "theirs") for o in offers if o.shard == shard and (d, target) in o.theirs
            ]
            if found:
                chosen[(shard, d)] = found[0]
            else:
                missing.append((*shard, d))
    if missing:
        raise TrainerError(
            f"the distributed optimizer's slice(s) {missing} (pp_rank, tp_rank, dp_rank) "
            f"at step {target} have no surviving copy: each lives on its data-parallel rank "
            "and, as a buddy copy, on the next one (dp_rank + 1 mod dp), and both died. "
            "Resume from the last checkpoint, or train with "
            "actor.megatron.distributed_optimizer=false (every rank keeps the whole moments)"
        )
    return target, chosen
