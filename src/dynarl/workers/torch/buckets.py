"""Collectives over many tensors at once: small tensors are coalesced into buckets,
large ones travel on their own, in place.

Both sides of a collective walk the same list of tensors (same order, dtypes and sizes)
and so cut the same buckets; no metadata travels. Each bucket is one collective, which
keeps the number of collectives low (a gloo collective costs ~0.1-1 ms before its first
byte) without copying large tensors.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend

Group = dist.ProcessGroup | Backend
"""A registered process group, or a standalone backend (a weight-sync group)."""

BucketHook = Callable[[int], None]
"""Called with the index of each bucket after its collective finished."""


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets: a tensor of at least ``bucket_bytes``
    alone, others coalesced in order while dtype and device agree and the bucket stays
    within ``bucket_bytes``. Depends only on dtypes, devices and sizes, so every rank
    cuts the same buckets."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, t in enumerate(tensors):
        size = t.numel() * t.element_size()
        if size >= bucket_bytes:
            if current:
                buckets.append(current)
                current, current_bytes = [], 0
            buckets.append([i])
            continue
        first = tensors[current[0]] if current else None
        fits = current_bytes + size <= bucket_bytes
        if first is not None and (first.dtype != t.dtype or first.device != t.device or not fits):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


class Staging:
    """Reusable bucket buffers, one per dtype and device.

    Keep one for the life of a trainer: a fresh buffer costs page faults on first touch
    (on some hosts more than the copy itself), a reused one does not.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A 1-d buffer of ``numel`` elements (a prefix of the kept one)."""
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buffer
        return buffer[:numel]


def allocate_bucketed(
    specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
    *,
    bucket_bytes: int,
    device: torch.device,
) -> list[torch.Tensor]:
    """Uninitialised tensors of ``specs`` (shape, dtype) laid out so that each bucket of
    :func:`plan_buckets` is one contiguous span: collectives then run on them in place,
    without staging copies."""
    metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
    tensors = list(metas)  # each replaced by its view below
    for bucket in plan_buckets(metas, bucket_bytes):
        numels = [metas[i].numel() for i in bucket]
        flat = torch.empty(sum(numels), dtype=metas[bucket[0]].dtype, device=device)
        offset = 0
        for i, numel in zip(bucket, numels, strict=True):
            tensors[i] = flat[offset : offset + numel].view(metas[i].shape)
            offset += numel
    return tensors


def _span(members: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-d view over ``members`` when they lie back to back in one storage."""
    first = members[0]
    expected = first.storage_offset()
    for t in members:
        same_storage = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (t.is_contiguous() and same_storage and t.storage_offset() == expected):
            return None
        expected += t.numel()
    return first.as_strided((expected - first.storage_offset(),), (1,), first.storage_offset())


def _run_buckets(
    tensors: Sequence[torch.Tensor],
    plan: Sequence[Sequence[int]],
    collective: Callable[[torch.Tensor], None],
    *,
    pack: bool,
    unpack: bool,
    staging: Staging | None,
    on_bucket: BucketHook | None,
) -> int:
    """Run ``collective`` once per bucket of ``plan`` (indices of ``tensors``). A
    bucket whose tensors lie back to back runs in place; otherwise ``pack`` copies them
    into a staging buffer before the collective and ``unpack`` copies it back after.
    Returns bytes moved."""
    staging = staging if staging is not None else Staging()
    moved = 0
    for index, bucket in enumerate(plan):
        members = [tensors[i] for i in bucket]
        flat = _span(members)
        if flat is not None:
            collective(flat)
        else:
            numels = [t.numel() for t in members]
            flat = staging.get(members[0].dtype, members[0].device, sum(numels))
            if pack:
                torch.cat([t.reshape(-1) for t in members], out=flat)
            collective(flat)
            if unpack:
                offset = 0
                for t, numel in zip(members, numels, strict=True):
                    t.copy_(flat[offset : offset + numel].view_as(t))
                    offset += numel
        moved += flat.numel() * flat.element_size()
        if on_bucket is not None:
            on_bucket(index)
    return moved


def broadcast(tensor: torch.Tensor, *, group: Group, group_src: int) -> None:
    """Broadcast one tensor in place from group rank ``group_src``; blocks until done."""
    options = dist.BroadcastOptions()
    options.rootRank = group_src
    options.rootTensor = 0
    # Backend (a standalone group) has broadcast at run time but not in its stub.
    group.broadcast([tensor], options).wait()  # type: ignore[union-attr]


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    group: Group,
    group_src: int,
    bucket_bytes: int,
    staging: Staging | None = None,
    on_bucket: BucketHook | None = None,
) -> int:
    """Broadcast ``tensors`` from group rank ``group_src``: its values land in place in
    every other rank's tensors (which must match in order, shapes and dtypes).

    Works on process groups registered with torch.distributed and on standalone ones.
    Returns the bytes broadcast.
    """
    return broadcast_buckets(
        tensors,
        plan_buckets(tensors, bucket_bytes),
        group=group,
        group_src=group_src,
        staging=staging,
        on_bucket=on_bucket,
    )


def broadcast_buckets(
    tensors: Sequence[torch.Tensor],
    plan: Sequence[Sequence[int]],
    *,
    group: Group,
    group_src: int,
    staging: Staging | None = None,
    on_bucket: BucketHook | None = None,
) -> int:
    """Broadcast ``tensors`` from group rank ``group_src``, one collective per bucket
    of ``plan`` (lists of indices into ``tensors``, each of one dtype): a bucket travels
    as its tensors flattened and concatenated in order. Returns the bytes broadcast."""
    is_source = group.rank() == group_src
    return _run_buckets(
        tensors,
        plan,
        lambda t: broadcast(t, group=group, group_src=group_src),
        pack=is_source,
        unpack=not is_source,
        staging=staging,
        on_bucket=on_bucket,
    )


def all_reduce_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    group: Group,
    bucket_bytes: int,
    staging: Staging | None = None,
) -> int:
    """Sum ``tensors`` in place over ``group``. Returns the bytes reduced per rank."""

    def collective(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    return _run_buckets(
        tensors,
        plan_buckets(tensors, bucket_bytes),
        collective,
        pack=True,
        unpack=True,
        staging=staging,
        on_bucket=None,
    )
