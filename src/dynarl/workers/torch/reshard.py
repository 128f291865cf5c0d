"""Resizing the data-parallel group on one worker, create-before-destroy.

A resize ``old -> new`` runs in two phases driven by the pool:

1. *prepare* — every worker of the world calls :func:`create_groups` (``new_group`` is
   collective over the world): the new data-parallel group, and a transfer group of one
   running rank (the source) plus the joiners. :func:`transfer_state` then checks the
   new group with one all-reduce and broadcasts parameters, buffers and AdamW state
   (``exp_avg``, ``exp_avg_sq``, ``step``) from the source into skeleton trainers on
   the joiners. The old group is not touched: it can keep training.
2. *commit* (every worker prepared) — :func:`commit_resize` switches members to the new
   group and releases leavers; or *abort* (any worker failed) — :func:`abort_resize`
   drops the new groups and the joiners' state, and the old group carries on.

The source first broadcasts a :class:`StateLayout` (names, shapes, optimizer structure,
scalars) as bytes, so a joiner checks it builds the same model before any tensor moves.
"""

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from dynarl.workers.errors import ReshardError
from dynarl.workers.torch.buckets import (
    BucketHook,
    Staging,
    allocate_bucketed,
    broadcast,
    broadcast_tensors,
)
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_commands import PrepareResize
from dynarl.workers.torch.trainer_errors import InjectedFaultError

logger = logging.getLogger(__name__)


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """Name, dtype and shape of one transferred tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class StateLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Everything about a trainer's state except the bulk tensors.

    Attributes:
        num_steps: optimizer steps taken.
        model: parameters then buffers, in module order.
        optimizer: the optimizer's tensor states in transfer order, named
            ``"<param index>.<key>"``.
        optimizer_scalars: per ``"<param index>.<key>"``, a scalar state kept by value
            (Adam's ``step``), with whether it was a 0-d tensor.
        param_groups: the optimizer's param groups (hyperparameters, param indices).
    """

    num_steps: int
    model: list[TensorSpec]
    optimizer: list[TensorSpec]
    optimizer_scalars: dict[str, tuple[float, str | None]]
    param_groups: list[dict[str, Any]]


@dataclass
class PendingResize:
    """What a worker prepared for one resize; switched to or dropped as a whole."""

    epoch: int
    members: tuple[int, ...]
    group: dist.ProcessGroup | None
    """The new data-parallel group (``None`` on workers outside it)."""
    transfer_group: dist.ProcessGroup | None
    """Source plus joiners (``None`` on other workers, or when nobody joins)."""
    source_rank: int = 0
    """The source's rank in the transfer group (torch orders a group's ranks by their
    world ranks, so a source with a higher world rank than a joiner is not rank 0)."""
    trainer: ElasticTrainer | None = None
    """A joiner's received trainer."""


def create_groups(
    command: PrepareResize,
    *,
    worker: int,
    ranks: Callable[[Sequence[int]], list[int]],
    timeout_s: float,
) -> PendingResize:
    """Create the new data-parallel group and the transfer group. Collective over the
    world: every worker calls it with the same command (whose workers are pool
    indices; ``ranks`` gives their world ranks)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    joiners = [m for m in command.new_members if m not in command.old_members]
    group = dist.new_group(ranks(command.new_members), timeout=timeout)
    transfer = None
    if joiners:
        transfer = dist.new_group(ranks([command.source, *joiners]), timeout=timeout)
    in_transfer = worker == command.source or worker in joiners
    transfer_ranks = ranks([command.source, *joiners])
    return PendingResize(
        epoch=command.epoch,
        members=command.new_members,
        group=group if worker in command.new_members else None,
        transfer_group=transfer if in_transfer else None,
        source_rank=sorted(transfer_ranks).index(transfer_ranks[0]),
    )


def transfer_state(
    pending: PendingResize,
    command: PrepareResize,
    *,
    worker: int,
    trainer: ElasticTrainer | None,
    make_skeleton: Callable[[], ElasticTrainer],
    device: torch.device,
    bucket_bytes: int,
) -> int:
    """This worker's part of the transfer: check the new group, then send (source) or
    receive (joiner) the trainer state. Returns the bytes moved by this worker."""
    if pending.group is not None:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=pending.group)
        if int(probe.item()) != len(pending.members):
            raise ReshardError(f"the new group answered {probe.item()} to a health check")
    if pending.transfer_group is None:
        return 0
    if worker == command.source:
        if trainer is None:
            raise ReshardError(f"source worker {worker} holds no trainer state")
        return send_state(
            trainer,
            group=pending.transfer_group,
            src=pending.source_rank,
            bucket_bytes=bucket_bytes,
        )
    skeleton = make_skeleton()
    on_bucket = None
    if command.fault is not None and command.fault.worker == worker:
        on_bucket = _fault_hook(command.fault.after_buckets)
    moved = receive_state(
        skeleton,
        group=pending.transfer_group,
        src=pending.source_rank,
        bucket_bytes=bucket_bytes,
        on_bucket=on_bucket,
    )
    pending.trainer = skeleton
    return moved


def commit_resize(
    pending: PendingResize, *, worker: int, trainer: ElasticTrainer | None
) -> ElasticTrainer | None:
    """Switch to the prepared group; returns this worker's trainer after the resize
    (``None`` for a worker outside the new group, whose state is released)."""
    old_group = trainer.group if trainer is not None else None
    _destroy(pending.transfer_group)
    kept: ElasticTrainer | None = None
    if worker in pending.members:
        kept = pending.trainer if pending.trainer is not None else trainer
        if kept is None:
            raise ReshardError(f"worker {worker} has no state to train with after the resize")
        kept.group = pending.group
    _destroy(old_group)
    if kept is None and trainer is not None:
        release_memory(trainer)
    return kept


def abort_resize(pending: PendingResize) -> None:
    """Drop everything ``pending`` created; the old group is left as it was."""
    _destroy(pending.transfer_group)
    _destroy(pending.group)
    if pending.trainer is not None:
        release_memory(pending.trainer)
    pending.trainer = pending.group = pending.transfer_group = None


def release_memory(trainer: ElasticTrainer) -> None:
    """Free a trainer's tensors now (the caller drops its last reference)."""
    device = trainer.device
    trainer.optimizer.state.clear()
    trainer.model.to_empty(device="meta")
    trainer.staging = Staging()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def send_state(
    trainer: ElasticTrainer, *, group: dist.ProcessGroup, src: int = 0, bucket_bytes: int
) -> int:
    """Broadcast ``trainer``'s layout and tensors from group rank ``src`` (this one)."""
    layout, optimizer_tensors = _describe(trainer)
    header = msgspec.msgpack.encode(layout)
    _broadcast_bytes(header, group=group, src=src, device=trainer.device)
    tensors = trainer.model_tensors() + optimizer_tensors
    return len(header) + broadcast_tensors(
        tensors, group=group, group_src=src, bucket_bytes=bucket_bytes, staging=trainer.staging
    )


def receive_state(
    skeleton: ElasticTrainer,
    *,
    group: dist.ProcessGroup,
    src: int = 0,
    bucket_bytes: int,
    on_bucket: BucketHook | None = None,
) -> int:
    """Receive a trainer state broadcast by group rank ``src`` into ``skeleton``."""
    header = _broadcast_bytes(None, group=group, src=src, device=skeleton.device)
    layout = msgspec.msgpack.decode(header, type=StateLayout)
    mine = [_spec(name, t) for name, t in skeleton.named_model_tensors()]
    if mine != layout.model:
        diff = next((a, b) for a, b in zip(mine, layout.model, strict=False) if a != b)
        raise ReshardError(
            f"the joiner builds a different model than the source ({len(mine)} vs "
            f"{len(layout.model)} tensors; first difference {diff}); give every worker "
            "the same model factory"
        )
    # Lay the joiner's fresh tensors out bucket by bucket, so it receives in place.
    specs = [(spec.shape, getattr(torch, spec.dtype)) for spec in layout.model + layout.optimizer]
    tensors = allocate_bucketed(specs, bucket_bytes=bucket_bytes, device=skeleton.device)
    model_tensors = [*skeleton.model.parameters(), *skeleton.model.buffers()]
    for target, view in zip(model_tensors, tensors, strict=False):
        target.data = view
    optimizer_tensors = tensors[len(model_tensors) :]
    moved = len(header) + broadcast_tensors(
        tensors, group=group, group_src=src, bucket_bytes=bucket_bytes, on_bucket=on_bucket
    )
    state: dict[int, dict[str, Any]] = {}
    for spec, tensor in zip(layout.optimizer, optimizer_tensors, strict=True):
        index, key = spec.name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for name, (value, dtype) in layout.optimizer_scalars.items():
        index, key = name.split(".", 1)
        scalar = value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
        state.setdefault(int(index), {})[key] = scalar
    own_groups = skeleton.optimizer.state_dict()["param_groups"]
    param_groups = [
        {k: tuple(v) if isinstance(own.get(k), tuple) else v for k, v in received.items()}
        for own, received in zip(own_groups, layout.param_groups, strict=True)
    ]
    skeleton.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    skeleton.num_steps = layout.num_steps
    return moved


def _describe(trainer: ElasticTrainer) -> tuple[StateLayout, list[torch.Tensor]]:
    """The layout of ``trainer``'s state and its optimizer tensors in transfer order."""
    optimizer_state = trainer.optimizer.state_dict()
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    scalars: dict[str, tuple[float, str | None]] = {}
    for index, entries in sorted(optimizer_state["state"].items()):
        for key, value in sorted(entries.items()):
            name = f"{index}.{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                specs.append(_spec(name, value))
                tensors.append(value)
            elif isinstance(value, torch.Tensor):  # 0-d, e.g. Adam's step: keep on CPU
                scalars[name] = (float(value.item()), _dtype_name(value.dtype))
            else:
                scalars[name] = (float(value), None)
    layout = StateLayout(
        num_steps=trainer.num_steps,
        model=[_spec(name, t) for name, t in trainer.named_model_tensors()],
        optimizer=specs,
        optimizer_scalars=scalars,
        param_groups=optimizer_state["param_groups"],
    )
    return layout, tensors


def _broadcast_bytes(
    data: bytes | None, *, group: dist.ProcessGroup, src: int, device: torch.device
) -> bytes:
    """Broadcast a byte string from group rank ``src`` (``data`` there, ``None``
    elsewhere)."""
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=device)
    broadcast(size, group=group, group_src=src)
    if data is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    broadcast(buffer, group=group, group_src=src)
    return bytes(buffer.cpu().numpy().tobytes())


def _spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, _dtype_name(tensor.dtype), tuple(tensor.shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fault_hook(after_buckets: int) -> BucketHook:
    def hook(index: int) -> None:
        if index + 1 == after_buckets:
            raise InjectedFaultError(f"injected fault after receiving {index + 1} bucket(s)")

    return hook


def _destroy(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.destroy_process_group(group)
