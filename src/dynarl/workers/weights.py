"""Weight sync from the trainer to the engines that serve a role: the group they join
and what an engine that receives weights does. Definitions only, no torch.

The group is a small world of its own (the shape of SGLang's
``init_weights_update_group``): the trainer's sending rank is rank 0 and hosts the
group's store at ``host:port``; engines join as ranks ``1..world_size - 1``. Weights
travel over torch.distributed (NCCL on GPUs, gloo on CPU), in buckets, tagged with a
version; they never ride the data plane.
"""

from typing import Protocol

import msgspec


class WeightSyncGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine joins the trainer's weight-sync group, and as which rank.

    Attributes:
        host, port: the group's store (hosted by the sender, rank 0).
        rank: this engine's rank (``>= 1``).
        world_size: the sender and every engine.
        timeout_s: how long joining, and each later collective, may wait.
    """

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float = 120.0


class WeightReceiver(Protocol):
    """An engine that takes the trainer's weights (rollout and inference both are)."""

    @property
    def weight_version(self) -> int:
        """Version of the weights it holds."""
        ...

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the weight-sync group; returns once every member joined."""
        ...

    async def receive_weights(self) -> int:
        """Receive the weights the sender broadcasts now; returns their version.
        Raises if the sender's model differs from this engine's (nothing is changed)."""
        ...

    async def leave_weight_sync(self) -> None:
        """Leave the group (collective: every member leaves at once); a no-op when in
        none."""
        ...

    def adopt_weight_sync(self, other: "WeightReceiver") -> bool:
        """Take over ``other``'s membership of the group, if the two share a process
        and a transport (two roles of one backend in one slot); returns whether it
        did (``other`` is then in none). A role switch then needs no new group."""
        ...
