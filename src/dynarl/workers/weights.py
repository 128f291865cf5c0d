"""Weight sync from the trainer to the engines that serve a role: the group they join
and what an engine that receives weights does. Definitions only, no torch.

The group is a small world of its own (the shape of SGLang's
``init_weights_update_group``): the trainer's sending rank is rank 0 and hosts the
group's store at ``host:port``; engines join as ranks ``1..world_size - 1`` (an engine
served by several tensor-parallel ranks takes as many consecutive ranks). Weights
travel over torch.distributed (NCCL on GPUs, gloo on CPU), in buckets; they never ride
the data plane.

What a sync sends is announced first, on the control plane: the trainer describes it
as a :class:`WeightManifest` (the version and, bucket by bucket, the tensors' names,
dtypes and shapes), every engine is handed the manifest, and then each bucket is one
broadcast from rank 0 of its tensors flattened and concatenated in order. That is the
layout SGLang's ``/update_weights_from_distributed`` takes with
``load_format="flattened_bucket"`` (it needs the names, dtypes and shapes in the HTTP
call before the broadcast), so SGLang servers and torch engines share one group.
"""

from typing import Protocol

import msgspec

GROUP_NAME = "dynarl-weight-sync"
"""The weight-sync group's name (SGLang's ``group_name``). Every member keys the group's
store as SGLang's ``init_custom_process_group`` does through torch's
``_new_process_group_helper``: ``{name}``, then ``{name}/``, then ``{device}/`` (``cuda``
for NCCL, ``cpu`` for gloo)."""


class WeightSyncGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine joins the trainer's weight-sync group, and as which rank.

    Attributes:
        host, port: the group's store (hosted by the sender, rank 0).
        rank: this engine's (first) rank (``>= 1``).
        world_size: the sender and every engine's ranks.
        timeout_s: how long joining, and each later collective, may wait.
        num_ranks: the ranks this engine takes, ``rank`` onwards: an engine on
            ``tp`` devices (an SGLang server) receives on each tensor-parallel rank.
    """

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float = 120.0
    num_ranks: int = 1


class WeightBucket(msgspec.Struct, frozen=True, kw_only=True):
    """The tensors of one broadcast, in order: one dtype for all (SGLang names it,
    ``"float32"``, ``"bfloat16"``), flattened and concatenated on the wire."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        """Elements the bucket's broadcast carries."""
        total = 0
        for shape in self.shapes:
            count = 1
            for size in shape:
                count *= size
            total += count
        return total


class WeightManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What one weight sync sends: the weights' ``version`` and its buckets, one
    broadcast each, in order. The trainer describes it
    (:meth:`~dynarl.workers.trainer.Trainer.weight_manifest`) before it sends; every
    receiver is handed it before the broadcast starts."""

    version: int
    buckets: tuple[WeightBucket, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor's name, in broadcast order."""
        return tuple(name for bucket in self.buckets for name in bucket.names)


class WeightReceiver(Protocol):
    """An engine that takes the trainer's weights (rollout and inference both are)."""

    @property
    def weight_version(self) -> int:
        """Version of the weights it holds."""
        ...

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the weight-sync group; returns once every member joined."""
        ...

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Receive the weights the sender broadcasts now, as ``manifest`` describes
        them; returns their version (``manifest.version``). Raises if the manifest
        does not fit this engine's model (nothing is changed)."""
        ...

    async def leave_weight_sync(self) -> None:
        """Leave the group (after the last sync returned everywhere; not a
        collective: an SGLang server joins no barrier); a no-op when in none."""
        ...

    def adopt_weight_sync(self, other: "WeightReceiver") -> bool:
        """Take over ``other``'s membership of the group, if the two share a process
        and a transport (two roles of one backend in one slot); returns whether it
        did (``other`` is then in none). A role switch then needs no new group."""
        ...
