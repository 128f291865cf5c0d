"""Weight sync from the trainer to the rollout engines over a torch.distributed group.

The group is its own small world, apart from the trainer's: the sending trainer rank is
its rank 0 and hosts its store at ``host:port``; engines join as ranks ``1..n-1``
(the shape of SGLang's ``init_weights_update_group``).

A sync of the run goes by manifest (:class:`~dynarl.workers.weights.WeightManifest`):
the sender describes it (:func:`manifest_of`), every engine checks it against its own
model before its parameters are touched (one that does not fit still takes the
broadcast in and throws it away, so nobody hangs), and each bucket is one broadcast of
its tensors flattened in order (:func:`send_by_manifest`, :func:`receive_by_manifest`) — the
layout SGLang servers take too. :func:`send_weights` / :func:`receive_weights` are the
older self-describing form between two torch processes (a header with the version,
tensor count, element count, a layout checksum and the bucket size, then the
buckets), kept for in-process tools and tests.
"""

import datetime
import functools
import logging
import math
import zlib

import anyio
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from dynarl.workers.errors import WeightManifestError, WeightSyncError
from dynarl.workers.torch.buckets import (
    Group,
    Staging,
    broadcast,
    broadcast_buckets,
    broadcast_tensors,
    plan_buckets,
)
from dynarl.workers.weights import GROUP_NAME, WeightBucket, WeightManifest, WeightSyncGroup

logger = logging.getLogger(__name__)

_HEADER_FIELDS = 5  # version, num_tensors, num_elements, layout checksum, bucket_bytes


def join_weight_sync_group(
    *,
    store: TCPStore | None = None,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
) -> Group:
    """Join the weight-sync group at ``host:port`` as ``rank`` (rank 0, the trainer,
    hosts the store: ``store``, opened beforehand on that port, else one it binds
    now). Blocks until all ``world_size`` members joined. Gloo on CPU, NCCL on CUDA;
    the group is independent of any default process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = group_store(store, device_type=device.type)
    group: Group
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    logger.info("joined weight-sync group %s:%d as rank %d/%d", host, port, rank, world_size)
    return group


def group_store(store: TCPStore, *, device_type: str, name: str = GROUP_NAME) -> PrefixStore:
    """The group's keys in ``store``, as an SGLang server's TP worker keys them
    (``init_custom_process_group`` prefixes the name, torch's
    ``_new_process_group_helper`` the name and a slash, then the device), so the
    trainer's sender, torch engines and SGLang servers meet in one group."""
    device = "cuda" if device_type == "cuda" else "cpu"
    return PrefixStore(f"{device}/", PrefixStore(f"{name}/", PrefixStore(name, store)))


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
        if group.num_ranks != 1:
            raise WeightSyncError(
                f"a torch engine takes one rank of the weight-sync group, not "
                f"{group.num_ranks}; give its role tp=1"
            )
        self.group = await anyio.to_thread.run_sync(functools.partial(join, group, device=device))

    async def leave(self) -> None:
        """Leave the group; a no-op when in none."""
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
    """Tear this member's side of the group down. Not a collective: an SGLang server
    leaves with ``/destroy_weights_update_group``, which joins no barrier. The caller
    guarantees no sync is in flight (every receiver's update returned before anyone
    leaves), so no peer uses a connection that closes."""
    shutdown = getattr(group, "shutdown", None)  # NCCL frees its communicator
    if callable(shutdown) and not isinstance(group, dist.ProcessGroupGloo):
        shutdown()


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


def manifest_of(model: torch.nn.Module, *, version: int, bucket_bytes: int) -> WeightManifest:
    """What :func:`send_by_manifest` sends of ``model``: its parameters in order, cut
    into buckets of one dtype and at most ``bucket_bytes`` (a larger tensor alone)."""
    named = list(model.named_parameters())
    plan = plan_buckets([p for _, p in named], bucket_bytes)
    buckets = []
    for bucket in plan:
        members = [named[i] for i in bucket]
        buckets.append(
            WeightBucket(
                names=tuple(name for name, _ in members),
                dtypes=tuple(dtype_name(p.dtype) for _, p in members),
                shapes=tuple(tuple(p.shape) for _, p in members),
            )
        )
    return WeightManifest(version=version, buckets=tuple(buckets))


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as SGLang names it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def send_by_manifest(
    model: torch.nn.Module,
    manifest: WeightManifest,
    *,
    group: Group,
    staging: Staging | None = None,
) -> int:
    """Broadcast ``model``'s parameters from group rank 0 as ``manifest`` describes
    them (one broadcast per bucket, its tensors flattened in order). Collective: every
    receiver takes the same manifest at the same time. Returns the bytes sent."""
    _check_manifest(manifest)
    tensors, plan = _layout(model, manifest, side="sender")
    with torch.no_grad():
        sent = broadcast_buckets(tensors, plan, group=group, group_src=0, staging=staging)
    logger.info("sent weights version %d (%d bytes)", manifest.version, sent)
    return sent


def receive_by_manifest(model: torch.nn.Module, manifest: WeightManifest, *, group: Group) -> int:
    """Receive the broadcast ``manifest`` describes into ``model``'s parameters in
    place; returns ``manifest.version``.

    Raises:
        WeightSyncError: the manifest itself is malformed (an empty bucket, one that
            mixes dtypes); the sender refuses it the same way, so nothing is sent.
        WeightManifestError: the manifest does not fit the model. The broadcast is
            still taken in, into scratch buffers with the model untouched, so the
            sender and the other members finish it rather than hang in the collective
            until the group's timeout (as an SGLang server that fails to load a
            bucket has received it).
    """
    _check_manifest(manifest)
    try:
        tensors, plan = _layout(model, manifest, side="engine")
    except WeightManifestError:
        _drain(manifest, group=group, device=next(model.parameters()).device)
        raise
    with torch.no_grad():
        broadcast_buckets(tensors, plan, group=group, group_src=0)
    return manifest.version


def _drain(manifest: WeightManifest, *, group: Group, device: torch.device) -> None:
    """Take in the broadcast of ``manifest`` and throw it away (a bucket at a time)."""
    staging = Staging()
    for bucket in manifest.buckets:
        numel = sum(math.prod(shape) for shape in bucket.shapes)
        buffer = staging.get(_dtype(bucket.dtypes[0]), device, numel)
        broadcast(buffer, group=group, group_src=0)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"the weight manifest names an unknown dtype {name!r}")
    return dtype


def _check_manifest(manifest: WeightManifest) -> None:
    """Refuse a malformed manifest, as the sender and every receiver do alike."""
    for bucket in manifest.buckets:
        if not bucket.names:
            raise WeightSyncError("the weight manifest has an empty bucket; drop it")
        if len(set(bucket.dtypes)) > 1:
            raise WeightSyncError(f"a weight bucket mixes dtypes ({bucket.dtypes}); one per bucket")
        _dtype(bucket.dtypes[0])


def _layout(
    model: torch.nn.Module, manifest: WeightManifest, *, side: str
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """``model``'s parameters in the manifest's order, and its buckets as indices;
    :class:`WeightManifestError` when they do not fit (check the manifest first)."""
    params = dict(model.named_parameters())
    names = manifest.names
    missing = [n for n in names if n not in params]
    unsent = [n for n in params if n not in set(names)]
    if missing or unsent:
        raise WeightManifestError(
            f"the weight manifest names {len(names)} tensors; this {side}'s model lacks "
            f"{missing[:3]} and the manifest lacks {unsent[:3]}: build both from the "
            f"same model config"
        )
    tensors: list[torch.Tensor] = []
    plan: list[list[int]] = []
    for bucket in manifest.buckets:
        indices = []
        for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
            p = params[name].data
            if tuple(p.shape) != tuple(shape) or dtype_name(p.dtype) != dtype:
                raise WeightManifestError(
                    f"the weight manifest has {name} as {dtype}{list(shape)}; this "
                    f"{side}'s model has {dtype_name(p.dtype)}{list(p.shape)}: build both "
                    f"from the same model config (and tokenizer)"
                )
            indices.append(len(tensors))
            tensors.append(p)
        plan.append(indices)
    return tensors, plan


def _checksum(model: torch.nn.Module) -> int:
    """CRC32 of the parameters' names, shapes and dtypes, in order."""
    layout = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters())
    return zlib.crc32(layout.encode())
