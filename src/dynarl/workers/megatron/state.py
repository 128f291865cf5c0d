"""Moving a Megatron trainer's state between workers: samples shared in a replica, the
reshard plan of a resize, and replica 0's shards gathered into the Hugging Face layout
(for a checkpoint or the rollout engines' weight sync).

A checkpoint holds the model and AdamW's moments in the HF layout (whole tensors,
HF names) beside the step counts: it does not depend on the layout that wrote it, so a
run resumes on any (dp, tp, pp) layout, and a torch run's tools can read its weights.
With Megatron's distributed optimizer the moments are first made whole from every
data-parallel rank's slice (and bf16 models add their fp32 main parameters, ``main``);
loading keeps each rank's slice.
"""

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import convert
from dynarl.workers.megatron.layout import Layout, RankGroups
from dynarl.workers.megatron.model import Architecture
from dynarl.workers.megatron.rank import MegatronRank
from dynarl.workers.torch import reshard
from dynarl.workers.torch.buckets import BucketHook, broadcast, broadcast_tensors
from dynarl.workers.torch.train_batch import TensorBatch
from dynarl.workers.torch.trainer_errors import InjectedFaultError
from dynarl.workers.torch.weights import load_weights

CHECKPOINT_FORMAT = "dynarl-megatron-hf-1"
"""The ``format`` entry of a checkpoint this module writes."""

_MOMENTS = ("exp_avg", "exp_avg_sq")
_STATE_KEYS = (*_MOMENTS, "main")
"""Whole per-parameter optimizer tensors a full state may hold (``main``: the
distributed optimizer's fp32 main parameters of a bf16 model)."""


# -- a replica's samples -----------------------------------------------------------


class _BatchHeader(msgspec.Struct, frozen=True, array_like=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]


def share_batch(
    batch: TensorBatch | None, *, group: dist.ProcessGroup, src: int, device: torch.device
) -> TensorBatch:
    """Named tensors (given on world rank ``src``, ``None`` elsewhere) on every worker
    of ``group``: a header of names, dtypes and shapes, then bucketed broadcasts."""
    group_src = dist.get_group_rank(group, src)
    header = None
    if batch is not None:
        header = _BatchHeader(
            names=list(batch),
            dtypes=[str(t.dtype).removeprefix("torch.") for t in batch.values()],
            shapes=[tuple(t.shape) for t in batch.values()],
        )
    raw = _broadcast_bytes(
        None if header is None else msgspec.msgpack.encode(header),
        group=group,
        group_src=group_src,
        device=device,
    )
    got = msgspec.msgpack.decode(raw, type=_BatchHeader)
    if batch is None:
        batch = {
            name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for name, dtype, shape in zip(got.names, got.dtypes, got.shapes, strict=True)
        }
    tensors = [t.contiguous() for t in batch.values()]
    broadcast_tensors(tensors, group=group, group_src=group_src, bucket_bytes=1 << 24)
    return dict(zip(got.names, tensors, strict=True))


def _broadcast_bytes(
    data: bytes | None, *, group: dist.ProcessGroup, group_src: int, device: torch.device
) -> bytes:
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=device)
    broadcast(size, group=group, group_src=group_src)
    if data is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    broadcast(buffer, group=group, group_src=group_src)
    return bytes(buffer.cpu().numpy().tobytes())


# -- the reshard plan of a resize ------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """One model shard ``(pp_rank, tp_rank)`` sent by ``source`` to ``receivers``."""

    shard: tuple[int, int]
    source: int
    receivers: tuple[int, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        """The transfer group's workers."""
        return (self.source, *self.receivers)


def transfer_plan(old: Layout, new: Layout, *, source: int) -> list[Move]:
    """What moves in a resize ``old -> new`` of one (tp, pp): for each shard, the
    workers of ``new`` that do not hold it in ``old`` receive it from the worker of
    ``source``'s replica that does. Workers holding the same shard in both keep it."""
    if (old.tp, old.pp) != (new.tp, new.pp):
        raise TrainerError(
            f"a resize keeps tp and pp (tp={old.tp}, pp={old.pp} -> tp={new.tp}, pp={new.pp})"
        )
    where = old.position(source)
    if where is None:
        raise TrainerError(f"source worker {source} is not a member of {old.members}")
    moves = []
    for pp_rank in range(new.pp):
        for tp_rank in range(new.tp):
            shard = (pp_rank, tp_rank)
            receivers = []
            for worker in new.members:
                before, after = old.position(worker), new.position(worker)
                assert after is not None
                if after.model_rank == shard and (before is None or before.model_rank != shard):
                    receivers.append(worker)
            if receivers:
                sender = old.at(where.dp_rank, pp_rank, tp_rank)
                moves.append(Move(shard=shard, source=sender, receivers=tuple(receivers)))
    return moves


def create_transfer_groups(
    plan: Sequence[Move], *, worker: int, timeout_s: float
) -> list[tuple[Move, dist.ProcessGroup]]:
    """One group per move (collective over the world, in plan order); returns the
    moves ``worker`` takes part in, with their groups, in plan order."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    mine = []
    for move in plan:
        group = dist.new_group(sorted(move.ranks), timeout=timeout)
        if worker in move.ranks:
            mine.append((move, group))
    return mine


@dataclass
class Moved:
    """What one worker's part of a plan's moves left: the shard it received (a new
    rank), and the bytes it sent and received."""

    received: MegatronRank | None = None
    sent_bytes: int = 0
    received_bytes: int = 0


def run_moves(
    transfer_groups: Sequence[tuple[Move, dist.ProcessGroup]],
    *,
    worker: int,
    rank: MegatronRank | None,
    make_empty: Callable[[], MegatronRank],
    bucket_bytes: int,
    on_bucket: BucketHook | None = None,
    moved: Moved | None = None,
) -> Moved:
    """``worker``'s part of a plan's moves (see :func:`create_transfer_groups`), in plan
    order: as a move's source it sends ``rank``'s whole state (parameters, AdamW
    moments, step) over the move's group, as a receiver it receives one into a fresh
    rank (``make_empty``; ``on_bucket`` after each bucket). Fills and returns
    ``moved`` (so a caller keeps what arrived before a later move failed)."""
    moved = Moved() if moved is None else moved
    for move, group in transfer_groups:
        src = sorted(move.ranks).index(move.source)
        if worker == move.source:
            if rank is None:
                raise TrainerError(f"world rank {worker}, a source of {move}, holds no state")
            moved.sent_bytes += reshard.send_state(
                rank, group=group, src=src, bucket_bytes=bucket_bytes
            )
            continue
        receiver = make_empty()
        moved.received_bytes += reshard.receive_state(
            receiver, group=group, src=src, bucket_bytes=bucket_bytes, on_bucket=on_bucket
        )
        moved.received = receiver
    return moved


def fault_hook(after_buckets: int) -> BucketHook:
    """Fails a receiver after ``after_buckets`` buckets (fault injection in tests)."""

    def hook(index: int) -> None:
        if index + 1 == after_buckets:
            raise InjectedFaultError(f"injected fault after receiving {index + 1} bucket(s)")

    return hook


# -- replica 0 in the HF layout ------------------------------------------------------


def _gather_to_leader(
    rank: MegatronRank, shard: dict[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]] | None:
    """Every worker of ``rank``'s replica gives ``shard``; the leader gets them in
    replica order (``None`` elsewhere)."""
    groups = rank.groups
    if groups.layout.replica_size == 1:
        return [shard]
    leader = groups.leader
    gathered: list[object] | None = [None] * groups.layout.replica_size if rank_is(leader) else None
    dist.gather_object(shard, gathered, dst=leader, group=groups.replica)
    if gathered is None:
        return None
    return [g for g in gathered if isinstance(g, dict)]


def rank_is(worker: int) -> bool:
    """Whether this process is world rank ``worker``."""
    return dist.get_rank() == worker


def _stages(
    layout: Layout, shards: list[dict[str, torch.Tensor]]
) -> list[list[dict[str, torch.Tensor]]]:
    return [shards[p * layout.tp : (p + 1) * layout.tp] for p in range(layout.pp)]


def gather_hf_weights(rank: MegatronRank) -> dict[str, torch.Tensor] | None:
    """The model in the HF layout on the replica leader (``None`` elsewhere)."""
    return gather_hf(rank, rank.named_shard())


def gather_hf(
    rank: MegatronRank, shard: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Tensors shaped like the parameters (``shard``: this worker's, by megatron
    name) in the HF layout on the replica leader (``None`` elsewhere). Collective over
    the replica."""
    shards = _gather_to_leader(rank, {n: t.detach().to("cpu", copy=True) for n, t in shard.items()})
    if shards is None:
        return None
    return convert.to_hf(_stages(rank.groups.layout, shards), rank.arch)


def copy_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load HF-layout ``weights`` into a ``transformers`` model (every parameter)."""
    own = {name for name, _ in model.named_parameters()}
    if own != set(weights):
        raise TrainerError(
            f"the exported weights do not fit the HF model: {sorted(own ^ set(weights))[:4]}"
        )
    load_weights(model, weights)


def whole_moments(rank: MegatronRank) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """``rank``'s optimizer tensors per parameter of its model shard (megatron names),
    whole, by key (``exp_avg``, ``exp_avg_sq``, and ``main`` for a bf16 model with the
    distributed optimizer; none before the first step), and the step count.
    Collective over the data-parallel group with the distributed optimizer."""
    if rank.distributed is not None:
        return rank.distributed.whole()
    moments: dict[str, dict[str, torch.Tensor]] = {key: {} for key in _MOMENTS}
    step = 0.0
    for name, param in rank.model.named_parameters():
        entry = rank.optimizer.state.get(param, {})
        for key in _MOMENTS:
            if key in entry:
                moments[key][name] = entry[key]
        if "step" in entry:
            step = float(entry["step"])
    return {k: v for k, v in moments.items() if v}, step


def gather_full_state(rank: MegatronRank, *, dp_rank: int = 0) -> dict[str, object] | None:
    """Model, AdamW moments and counters in the HF layout, on the leader of replica
    ``dp_rank`` (``None`` elsewhere). Every member calls it (collective over the
    data-parallel group with the distributed optimizer, then over that replica)."""
    moments_here, step = whole_moments(rank)
    if rank.groups.position.dp_rank != dp_rank:
        return None
    local: dict[str, torch.Tensor] = {
        n: p.detach().to("cpu", copy=True) for n, p in rank.model.named_parameters()
    }
    for key, tensors in moments_here.items():
        for name, tensor in tensors.items():
            local[f"{key}/{name}"] = tensor.detach().to("cpu", copy=True)
    shards = _gather_to_leader(rank, local)
    if shards is None:
        return None
    stages = _stages(rank.groups.layout, shards)
    model = convert.to_hf([[_select(s, "") for s in st] for st in stages], rank.arch)
    moments = {}
    for key in _STATE_KEYS:
        if all(_select(s, key) for s in shards):
            moments[key] = convert.to_hf(
                [[_select(s, key) for s in st] for st in stages], rank.arch
            )
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model,
        **moments,
        "step": step,
        "num_steps": rank.num_steps,
        "torch_rng": torch.get_rng_state(),
    }


def _select(shard: Mapping[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    if not key:
        return {n: t for n, t in shard.items() if "/" not in n}
    prefix = f"{key}/"
    return {n.removeprefix(prefix): t for n, t in shard.items() if n.startswith(prefix)}


def write_checkpoint(full: Mapping[str, object], path: str) -> None:
    """``torch.save`` ``full`` to ``path`` atomically (a crash leaves the old file)."""
    tmp = f"{path}.tmp"
    torch.save(dict(full), tmp)
    os.replace(tmp, path)


def load_checkpoint(rank: MegatronRank, path: str) -> None:
    """Continue ``rank`` from the checkpoint at ``path``: its shard of the weights and
    AdamW moments, the step counts and the RNG."""
    try:
        full = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise TrainerError(f"cannot read the checkpoint {path}: {exc}") from exc
    if not isinstance(full, dict) or full.get("format") != CHECKPOINT_FORMAT:
        raise TrainerError(
            f"{path} is not a checkpoint of the megatron backend (format {CHECKPOINT_FORMAT}); "
            "resume with the actor.backend of the run that wrote it"
        )
    load_full_state(rank, full, source=path)
    rng = full.get("torch_rng")
    if isinstance(rng, torch.Tensor):
        torch.set_rng_state(rng)


def load_full_state(rank: MegatronRank, full: Mapping[str, Any], *, source: str) -> None:
    """Make ``rank`` hold its shard of ``full`` (see :func:`gather_full_state`):
    weights, AdamW moments and step counts."""
    p = rank.groups.position
    layout = rank.groups.layout
    try:
        cut = cut_state(
            full, rank.arch, tp_rank=p.tp_rank, tp=layout.tp, pp_rank=p.pp_rank, pp=layout.pp
        )
    except KeyError as exc:
        raise TrainerError(f"the state of {source} lacks {exc}; it is not a full state") from exc
    load_cut(rank, cut, source=source)


def cut_state(
    full: Mapping[str, Any], arch: Architecture, *, tp_rank: int, tp: int, pp_rank: int, pp: int
) -> TensorBatch:
    """The shard ``(tp_rank, pp_rank)`` of a full state, as flat named tensors:
    ``model/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>`` (megatron names),
    ``step`` and ``num_steps`` (what one new member of a reshard receives)."""
    flat: TensorBatch = {
        "step": torch.tensor(float(full.get("step", 0.0)), dtype=torch.float64),
        "num_steps": torch.tensor(int(full.get("num_steps", 0)), dtype=torch.int64),
    }
    position = {"tp_rank": tp_rank, "tp": tp, "pp_rank": pp_rank, "pp": pp}
    for key in ("model", *_STATE_KEYS):
        if key in full:
            for name, tensor in convert.to_megatron(full[key], arch, **position).items():
                flat[f"{key}/{name}"] = tensor
    return flat


def local_cut(rank: MegatronRank) -> TensorBatch:
    """``rank``'s own shard as a :func:`cut_state` of its position (whole moments,
    megatron names, no HF conversion): what a data-parallel resize sends a worker that
    takes the same position. Collective over the data-parallel group with the
    distributed optimizer."""
    moments, step = whole_moments(rank)
    flat: TensorBatch = {
        "step": torch.tensor(step, dtype=torch.float64),
        "num_steps": torch.tensor(rank.num_steps, dtype=torch.int64),
    }
    for name, param in rank.model.named_parameters():
        flat[f"model/{name}"] = param.detach()
    for key, tensors in moments.items():
        for name, tensor in tensors.items():
            flat[f"{key}/{name}"] = tensor
    return flat


def load_cut(rank: MegatronRank, flat: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Make ``rank`` hold a :func:`cut_state` of its own position."""
    weights = _select(flat, "model")
    try:
        convert.load_into(rank.model, weights)
    except ValueError as exc:
        raise TrainerError(
            f"the state of {source} does not fit this model ({exc}); resume with the model "
            "settings of the run that wrote it"
        ) from exc
    moments = {k: _select(flat, k) for k in _STATE_KEYS}
    step = float(flat["step"])
    rank.num_steps = int(flat["num_steps"])
    if rank.distributed is not None:
        rank.distributed.load(
            {k: v for k, v in moments.items() if v}, step, num_steps=rank.num_steps
        )
        return
    named = dict(rank.model.named_parameters())
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    if all(moments[k] for k in _MOMENTS):
        for index, name in enumerate(named):
            optimizer_state[index] = {
                "step": torch.tensor(step),
                **{k: moments[k][name].clone() for k in _MOMENTS},
            }
    groups = rank.optimizer.state_dict()["param_groups"]
    rank.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def regrouped(
    rank: MegatronRank, groups: RankGroups, make_empty: Callable[[], MegatronRank]
) -> MegatronRank:
    """``rank`` on another layout's ``groups``, keeping its position's state. With one
    worker a replica only its data-parallel wrapper changes
    (:meth:`MegatronRank.regroup`); a model cut into shards keeps its tensor and
    pipeline groups in its layers, so its state is copied into a fresh rank built on
    ``groups`` (``make_empty``; the caller releases ``rank``)."""
    if rank.groups.layout.replica_size == 1:
        rank.regroup(groups)
        return rank
    fresh = make_empty()
    load_cut(fresh, local_cut(rank), source="its own rank")
    return fresh
