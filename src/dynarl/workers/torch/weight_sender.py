"""The trainer pool's end of the weight-sync group: which worker sends, and the calls
that open its store, join it, describe and send the weights, and leave it.

The sender is the trainer's rank 0 when it joins; a resize or a recovery that makes
another worker rank 0 leaves the group's sender behind, and the sends are refused
until the group is joined again with the new rank 0.
"""

from collections.abc import Sequence
from typing import Literal

from dynarl.workers.errors import WeightSyncError
from dynarl.workers.torch.trainer_calls import WorkerCalls, check
from dynarl.workers.torch.trainer_commands import (
    ConnectWeightSync,
    DescribeWeights,
    Done,
    LeaveWeightSync,
    OpenStore,
    StoreOpened,
    SyncWeights,
    WeightsDescribed,
)
from dynarl.workers.weights import WeightManifest


async def open_store(  # noqa: PLR0917 (a command's fields)
    calls: WorkerCalls,
    worker: int,
    purpose: Literal["world", "weight_sync"],
    host: str,
    world_size: int,
    timeout_s: float,
) -> int:
    """Make ``worker`` open the TCP store of a ``purpose`` group of ``world_size`` on a
    free port of ``host``; returns the port."""
    command = OpenStore(
        worker=worker, purpose=purpose, host=host, world_size=world_size, timeout_s=timeout_s
    )
    [reply] = check(await calls.call([worker], command))
    assert isinstance(reply, StoreOpened)
    return reply.port


class WeightSender:
    """The sending worker of a trainer pool's weight-sync group, reached by ``calls``."""

    def __init__(self, calls: WorkerCalls) -> None:
        self._calls = calls
        self.worker: int | None = None
        """The worker that sends in the group (``None`` without a group)."""

    async def open(self, worker: int, host: str, world_size: int, timeout_s: float) -> int:
        """``worker`` opens the group's store on a free port of ``host``; the port."""
        return await open_store(self._calls, worker, "weight_sync", host, world_size, timeout_s)

    async def connect(
        self, worker: int, host: str, port: int, world_size: int, timeout_s: float
    ) -> None:
        """``worker`` joins the group at ``host:port`` as its sender (group rank 0)."""
        command = ConnectWeightSync(
            host=host, port=port, world_size=world_size, timeout_s=timeout_s
        )
        check(await self._calls.call([worker], command))
        self.worker = worker

    async def leave(self) -> None:
        """The sender leaves the group; a no-op without one."""
        if self.worker is None:
            return
        worker, self.worker = self.worker, None
        check(await self._calls.call([worker], LeaveWeightSync()))

    def forget_dead(self) -> None:
        """Drop a sender that died (its group is gone with it)."""
        if self.worker in self._calls.casualties.dead:
            self.worker = None

    def checked(self, holders: Sequence[int]) -> int:
        """The sender, if it is still among ``holders`` (the workers holding the whole
        weights the group is sent); else :class:`~dynarl.workers.errors.WeightSyncError`
        saying what to do."""
        if self.worker is None:
            raise WeightSyncError("no weight-sync group; call connect_weight_sync first")
        if self.worker not in holders:
            raise WeightSyncError(
                f"worker {self.worker}, the sender of the weight-sync group, no longer holds "
                "the trainer's weights; call connect_weight_sync again with the new rank 0"
            )
        return self.worker

    async def manifest(self, worker: int, version: int) -> WeightManifest:
        """What ``worker`` will send as ``version``."""
        [reply] = check(await self._calls.call([worker], DescribeWeights(version=version)))
        assert isinstance(reply, WeightsDescribed)
        return reply.manifest

    async def send(self, workers: Sequence[int], version: int) -> int:
        """Send the weights tagged ``version`` (``workers`` take part, the first is the
        sender); returns the bytes sent."""
        reply = check(await self._calls.call(workers, SyncWeights(version=version)))[0]
        assert isinstance(reply, Done)
        return reply.bytes_moved
