"""Minibatches on the trainer side: wire arrays to tensors, the deterministic split of
a global minibatch over data-parallel ranks, and micro-batches.

Every tensor of a minibatch has the samples on dimension 0. Rank ``r`` of ``n`` takes a
contiguous block of samples (the first ``len % n`` ranks one more), and cuts it into
micro-batches of fixed size in order. With the micro-batch size fixed, every
data-parallel size sees the same micro-batches when the blocks align with them.
"""

from collections.abc import Iterator, Mapping

import torch

from dynarl.workers.errors import TrainerError
from dynarl.workers.trainer import Array
from dynarl.workers.trainer_items import shard_bounds

TensorBatch = dict[str, torch.Tensor]
"""A minibatch or micro-batch: named tensors with the samples on dimension 0."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def to_tensors(arrays: Mapping[str, Array], device: torch.device) -> TensorBatch:
    """Tensors on ``device`` holding ``arrays`` (numpy dtype names, C-order bytes)."""
    batch: TensorBatch = {}
    for name, array in arrays.items():
        dtype = _DTYPES.get(array.dtype)
        if dtype is None:
            raise TrainerError(
                f"minibatch field {name!r} has dtype {array.dtype!r}; send one of {sorted(_DTYPES)}"
            )
        flat = torch.frombuffer(bytearray(array.data), dtype=dtype)
        batch[name] = flat.reshape(array.shape).to(device)
    return batch


def num_samples(batch: Mapping[str, torch.Tensor]) -> int:
    """Samples in ``batch``; every field must agree on dimension 0."""
    sizes = {name: int(t.shape[0]) for name, t in batch.items()}
    if not sizes:
        raise TrainerError("the minibatch has no fields; send at least input_ids")
    if len(set(sizes.values())) != 1:
        raise TrainerError(f"minibatch fields disagree on the number of samples: {sizes}")
    return next(iter(sizes.values()))


def shard(batch: Mapping[str, torch.Tensor], rank: int, world_size: int) -> TensorBatch:
    """The contiguous block of ``batch`` that rank ``rank`` of ``world_size`` trains on."""
    start, stop = shard_bounds(num_samples(batch), rank, world_size)
    return {name: t[start:stop] for name, t in batch.items()}


def micro_batches(batch: Mapping[str, torch.Tensor], size: int) -> Iterator[TensorBatch]:
    """``batch`` cut in order into micro-batches of ``size`` samples (the last may be
    smaller); nothing for an empty batch."""
    total = num_samples(batch)
    for start in range(0, total, size):
        yield {name: t[start : start + size] for name, t in batch.items()}
