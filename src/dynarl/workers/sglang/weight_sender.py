"""The trainer's side of SGLang's weight sync: join the group an SGLang server joins
with ``/init_weights_update_group`` (as its rank 0, hosting the store, the group named
as the server names it) and broadcast each tensor of a bucket, in the order of the
bucket's ``names``, while the engine posts ``/update_weights_from_distributed``.

This mirrors what SGLang's own tests do on the trainer side
(``init_custom_process_group`` over a TCP store prefixed with the group name); on GPUs
the group is NCCL, here gloo. The trainer backend does not call it yet: its broadcast
is the torch backend's in-band one.
"""

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from dynarl.workers.sglang.messages import WeightBucket
from dynarl.workers.sglang.rollout import GROUP_NAME
from dynarl.workers.torch.buckets import Group, broadcast


def join_sender(*, host: str, port: int, world_size: int, timeout_s: float = 120.0) -> Group:
    """Host the weight-sync group's store at ``host:port`` and join it as rank 0
    (blocks until every server joined)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=True, timeout=timeout)
    prefixed = PrefixStore(GROUP_NAME, store)
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, 0, world_size, options)
    return dist.ProcessGroupGloo(prefixed, 0, world_size, timeout)


def buckets_of(model: torch.nn.Module, *, bucket_bytes: int) -> list[WeightBucket]:
    """``model``'s parameters as buckets of at most ``bucket_bytes`` (a larger tensor
    alone), in parameter order."""
    buckets: list[WeightBucket] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    size = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if names and size + nbytes > bucket_bytes:
            buckets.append(
                WeightBucket(names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(shapes))
            )
            names, dtypes, shapes, size = [], [], [], 0
        names.append(name)
        dtypes.append(str(p.dtype).removeprefix("torch."))
        shapes.append(tuple(p.shape))
        size += nbytes
    if names:
        buckets.append(WeightBucket(names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(shapes)))
    return buckets


def send_buckets(model: torch.nn.Module, buckets: Sequence[WeightBucket], *, group: Group) -> int:
    """Broadcast every tensor of ``buckets`` from rank 0, in order; returns the bytes."""
    params = dict(model.named_parameters())
    sent = 0
    with torch.no_grad():
        for bucket in buckets:
            for name in bucket.names:
                tensor = params[name].data.contiguous()
                broadcast(tensor, group=group, group_src=0)
                sent += tensor.numel() * tensor.element_size()
    return sent
