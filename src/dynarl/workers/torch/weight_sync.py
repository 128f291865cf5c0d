"""Weight sync from the trainer to the rollout engines over a torch.distributed group.

The group is its own small world, apart from the trainer's: the sending trainer rank is
its rank 0 and hosts its store at ``host:port``; engines join as ranks ``1..n-1``
(the shape of SGLang's ``init_weights_update_group``). Each sync broadcasts a header
(version, tensor count, element count, a checksum of names/shapes/dtypes, bucket size)
and then the parameters in buckets, so engines check they hold the same model and
learn the version that travels with the weights.
"""

import datetime
import functools
import logging
import zlib

import anyio
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from dynarl.workers.errors import WeightSyncError
from dynarl.workers.torch.buckets import Group, Staging, broadcast, broadcast_tensors
from dynarl.workers.weights import WeightSyncGroup

logger = logging.getLogger(__name__)

_HEADER_FIELDS = 5  # version, num_tensors, num_elements, layout checksum, bucket_bytes


def join_weight_sync_group(
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
) -> Group:
    """Join the weight-sync group at ``host:port`` as ``rank`` (rank 0, the trainer,
    hosts the store). Blocks until all ``world_size`` members joined. Gloo on CPU,
    NCCL on CUDA; the group is independent of any default process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = PrefixStore("dynarl-weight-sync", store)
    group: Group
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    logger.info("joined weight-sync group %s:%d as rank %d/%d", host, port, rank, world_size)
    return group


def join(group: WeightSyncGroup, *, device: torch.device) -> Group:
    """Join ``group`` as the rank it names (see :func:`join_weight_sync_group`)."""
    return join_weight_sync_group(
        host=group.host,
        port=group.port,
        rank=group.rank,
        world_size=group.world_size,
        device=device,
        timeout_s=group.timeout_s,
    )


class Membership:
    """An engine's membership of the weight-sync group (in a worker process), which
    another torch engine of the same process may take over (a slot switching roles
    keeps its place in the group)."""

    def __init__(self) -> None:
        self.group: Group | None = None

    async def join(self, group: WeightSyncGroup, *, device: torch.device) -> None:
        """Join ``group`` (blocks a thread until every member joined)."""
        self.group = await anyio.to_thread.run_sync(
            functools.partial(join, group, device=device)
        )

    async def leave(self) -> None:
        """Leave the group (collective); a no-op when in none."""
        if self.group is not None:
            group, self.group = self.group, None
            await anyio.to_thread.run_sync(leave_weight_sync_group, group)

    def adopt(self, other: object) -> bool:
        """Take ``other``'s group if it is a membership of this process in one."""
        if not isinstance(other, Membership) or other.group is None:
            return False
        self.group, other.group = other.group, None
        return True


def leave_weight_sync_group(group: Group) -> None:
    """Collective: every member calls it after its last sync, so no member tears the
    group down (or exits) while a peer still uses it — gloo aborts the process when a
    peer's connection closes under it."""
    # Backend (a standalone group) has barrier at run time but not in its stub.
    group.barrier().wait()  # type: ignore[union-attr]


def send_weights(
    model: torch.nn.Module,
    *,
    version: int,
    group: Group,
    bucket_bytes: int,
    staging: Staging | None = None,
) -> int:
    """Broadcast ``model``'s parameters tagged ``version`` from group rank 0, packing
    small ones through ``staging`` (pass a kept one to avoid fresh buffers).
    Collective: every engine calls :func:`receive_weights` at the same time. Returns
    the bytes sent."""
    params = [p.data for p in model.parameters()]
    header = torch.tensor(
        [version, len(params), sum(p.numel() for p in params), _checksum(model), bucket_bytes],
        dtype=torch.int64,
        device=params[0].device,
    )
    broadcast(header, group=group, group_src=0)
    with torch.no_grad():
        sent = broadcast_tensors(
            params, group=group, group_src=0, bucket_bytes=bucket_bytes, staging=staging
        )
    logger.info("sent weights version %d (%d bytes)", version, sent)
    return sent


def receive_weights(model: torch.nn.Module, *, group: Group) -> int:
    """Receive a broadcast of :func:`send_weights` into ``model``'s parameters in place
    and return its version. Raises :class:`WeightSyncError` (before any parameter is
    touched) when the sender's model differs in names, shapes or dtypes; the sender
    then fails on its timeout."""
    params = [p.data for p in model.parameters()]
    header = torch.zeros(_HEADER_FIELDS, dtype=torch.int64, device=params[0].device)
    broadcast(header, group=group, group_src=0)
    version, num_tensors, num_elements, checksum, bucket_bytes = (int(x) for x in header.tolist())
    mine = (len(params), sum(p.numel() for p in params), _checksum(model))
    if mine != (num_tensors, num_elements, checksum):
        raise WeightSyncError(
            f"the trainer sends {num_tensors} tensors / {num_elements} elements "
            f"(layout checksum {checksum}) but this model has {mine[0]} / {mine[1]} "
            f"(checksum {mine[2]}); build the engine's model from the trainer's config"
        )
    with torch.no_grad():
        broadcast_tensors(params, group=group, group_src=0, bucket_bytes=bucket_bytes)
    return version


def _checksum(model: torch.nn.Module) -> int:
    """CRC32 of the parameters' names, shapes and dtypes, in order."""
    layout = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters())
    return zlib.crc32(layout.encode())
