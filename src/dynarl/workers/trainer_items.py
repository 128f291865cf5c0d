"""A minibatch as items of the data router: each sample is an item on the actor's
edge, routed to the trainer rank that trains it (its contiguous data-parallel shard),
which stacks its samples back into its part of the minibatch.

The split is the trainer's own (:func:`shard_bounds`: rank ``r`` of ``n`` takes a
contiguous block, the first ``len % n`` ranks one more), and every sample carries the
minibatch's padded width, so a rank trains on exactly the tensors it would have cut
out of the whole minibatch.
"""

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.core.ids import EdgeId, GroupId, InstanceId, ItemId
from dynarl.data.wire import Item
from dynarl.workers.trainer import Array, Minibatch, SampleRow

_ENCODER = msgspec.msgpack.Encoder()
_ROW = msgspec.msgpack.Decoder(SampleRow)


def shard_bounds(num: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the samples rank ``rank`` of ``world_size`` trains on."""
    base, extra = divmod(num, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def to_array(array: npt.NDArray[Any]) -> Array:
    """``array`` on the wire."""
    contiguous = np.asarray(array, order="C")  # (ascontiguousarray makes a scalar 1-d)
    return Array(dtype=str(contiguous.dtype), shape=contiguous.shape, data=contiguous.tobytes())


def from_array(array: Array) -> npt.NDArray[Any]:
    """The numpy array ``array`` holds."""
    return np.frombuffer(array.data, dtype=np.dtype(array.dtype)).reshape(array.shape)


def shard_items(
    minibatch: Minibatch,
    ids: Sequence[ItemId],
    groups: Sequence[GroupId],
    ranks: Sequence[InstanceId],
    *,
    edge: EdgeId,
) -> tuple[list[Item], list[tuple[str, ...]]]:
    """The items of ``minibatch``'s samples (sample ``i`` is ``ids[i]`` of
    ``groups[i]``), each bound to the instance of the rank whose shard holds it
    (``ranks`` in data-parallel order), and each rank's item ids in order."""
    items: list[Item] = []
    shards: list[tuple[str, ...]] = []
    for rank, instance in enumerate(ranks):
        start, stop = shard_bounds(len(ids), rank, len(ranks))
        shards.append(tuple(ids[start:stop]))
        for i in range(start, stop):
            row = SampleRow(fields={k: to_array(v[i]) for k, v in minibatch.items()})
            items.append(
                Item(
                    id=ids[i],
                    group=groups[i],
                    edge=edge,
                    payload=_ENCODER.encode(row),
                    affinity="must",
                    instance=instance,
                )
            )
    return items, shards


def stack_rows(payloads: Sequence[bytes]) -> dict[str, Array]:
    """A rank's part of the minibatch from its items' payloads, in order."""
    rows = [_ROW.decode(p) for p in payloads]
    if not rows:
        return {}
    return {
        name: to_array(np.stack([from_array(r.fields[name]) for r in rows]))
        for name in rows[0].fields
    }
