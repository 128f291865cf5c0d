"""Time models for the compute-bound stages and for moving things between devices.

Inference (log-prob forward) and the actor (forward, backward, optimizer) are
compute-bound: their time is FLOPs / (devices x peak x MFU x data-parallel efficiency).
Weight sync and migrations cost a setup time plus bytes over a link. The migration
defaults are fitted to the reference system's measurements: trainer reshard ≈0.5 s
(1.5B) to ≈2.8 s (32B); rollout migration 3.5–5 s median, ≈7.5 s worst, dominated by
setup (engine resume, group rebuild, graph capture), not bytes.
"""

import math
from collections.abc import Sequence

import msgspec

from dynarl.control.plan import MigrationKind
from dynarl.core.ids import ComponentKind
from dynarl.sim.errors import SimError
from dynarl.sim.hardware import GpuProfile
from dynarl.sim.models import ModelProfile


def attended_context(lengths: Sequence[int]) -> float:
    """The mean context a token of these sequences attends to (causal attention: a
    sequence of ``L`` tokens makes ``L**2 / 2`` token-context pairs), weighted by
    tokens. With heavy-tailed lengths this is far above half the mean length, and the
    long sequences' attention FLOPs are what it counts."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / (2 * total) if total else 0.0


def expected_longest(lengths: Sequence[int], k: int) -> float:
    """The expected longest of ``k`` sequences drawn at random (with replacement) from
    ``lengths``: what a minibatch padded to its longest row is padded to. The ``i``-th
    shortest of ``N`` is the longest with probability ``(i/N)**k - ((i-1)/N)**k``."""
    ordered = sorted(lengths)
    n = len(ordered)
    if not n or k <= 0:
        return 0.0
    return sum(x * ((i / n) ** k - ((i - 1) / n) ** k) for i, x in enumerate(ordered, 1))


class DataParallelEfficiency(msgspec.Struct, frozen=True, kw_only=True):
    """Scaling efficiency of ``n`` data-parallel replicas: ``1 / (1 + alpha *
    log2(n))`` (gradient all-reduce and stragglers grow with the log of the group)."""

    alpha: float = 0.03

    def __call__(self, num_replicas: int) -> float:
        """Efficiency in (0, 1] for ``num_replicas`` replicas."""
        if num_replicas < 1:
            raise SimError(f"num_replicas={num_replicas}: need at least one replica")
        return 1.0 / (1.0 + self.alpha * math.log2(num_replicas))


def _check_devices(num_devices: int, unit: int, what: str) -> int:
    if num_devices < unit or num_devices % unit:
        raise SimError(
            f"{what} on {num_devices} devices: need a positive multiple of its instance size {unit}"
        )
    return num_devices // unit


class InferenceCost(msgspec.Struct, frozen=True, kw_only=True):
    """Log-prob inference: one forward over prompt plus response tokens.

    ``tp`` devices make one replica; replicas split the samples.
    """

    gpu: GpuProfile
    model: ModelProfile
    tp: int = 1
    mfu: float = 0.4
    efficiency: DataParallelEfficiency = msgspec.field(default_factory=DataParallelEfficiency)
    num_forwards: int = 1  # 2 with a reference model

    def time_s(self, num_tokens: float, num_devices: int, mean_context: float = 0.0) -> float:
        """Seconds to score ``num_tokens`` tokens on ``num_devices`` devices;
        ``mean_context`` is the mean context a token attends to (half a sequence)."""
        replicas = _check_devices(num_devices, self.tp, "inference")
        flops = self.num_forwards * num_tokens * self.model.forward_flops_per_token(mean_context)
        rate = num_devices * self.gpu.bf16_flops_per_s * self.mfu * self.efficiency(replicas)
        return flops / rate

    def tokens_per_s(self, num_devices: int, mean_context: float = 0.0) -> float:
        """Throughput in tokens per second on ``num_devices`` devices."""
        return 1.0 / self.time_s(1.0, num_devices, mean_context)


class ActorCost(msgspec.Struct, frozen=True, kw_only=True):
    """The trainer: ``n_minibatches`` optimizer steps per iteration.

    A step is forward plus backward over its tokens (compute-bound) plus the optimizer
    update, which reads and writes the sharded fp32 state (``state_bytes_per_param``
    per parameter, memory-bound). ``tp x pp`` devices make one data-parallel replica.
    """

    gpu: GpuProfile
    model: ModelProfile
    tp: int = 1
    pp: int = 1
    mfu: float = 0.35
    n_minibatches: int = 4
    state_bytes_per_param: int = 16
    efficiency: DataParallelEfficiency = msgspec.field(default_factory=DataParallelEfficiency)

    @property
    def replica_devices(self) -> int:
        """Devices per data-parallel replica."""
        return self.tp * self.pp

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and Adam state of the whole model."""
        return self.model.num_params * self.state_bytes_per_param

    def step_time_s(self, num_tokens: float, num_devices: int, mean_context: float = 0.0) -> float:
        """Seconds of one optimizer step over ``num_tokens`` tokens on ``num_devices``."""
        replicas = _check_devices(num_devices, self.replica_devices, "the actor")
        flops = num_tokens * self.model.train_flops_per_token(mean_context)
        rate = num_devices * self.gpu.bf16_flops_per_s * self.mfu * self.efficiency(replicas)
        update = 2 * self.state_bytes / num_devices / self.gpu.hbm_bytes_per_s
        return flops / rate + update

    def iteration_time_s(
        self, num_tokens: float, num_devices: int, mean_context: float = 0.0
    ) -> float:
        """Seconds of all ``n_minibatches`` steps over an iteration's ``num_tokens``."""
        per_step = num_tokens / self.n_minibatches
        return self.n_minibatches * self.step_time_s(per_step, num_devices, mean_context)


class WeightSyncCost(msgspec.Struct, frozen=True, kw_only=True):
    """Trainer to rollout weight sync: a setup (group handshake, pause, cache flush)
    plus the bf16 weights over one link (broadcast pipelines, so the slowest hop
    counts once)."""

    setup_s: float = 0.3
    bandwidth_bytes_per_s: float = 50e9  # one 400 Gb/s NIC; NVLink when colocated

    def time_s(self, model: ModelProfile) -> float:
        """Seconds to push ``model``'s weights to every engine."""
        return self.setup_s + model.weight_bytes / self.bandwidth_bytes_per_s


class MigrationCost(msgspec.Struct, frozen=True, kw_only=True):
    """One kind of migration: ``setup_s + bytes / bandwidth_bytes_per_s``."""

    setup_s: float
    bandwidth_bytes_per_s: float

    def time_s(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes``."""
        return self.setup_s + num_bytes / self.bandwidth_bytes_per_s


class MigrationCostModel(msgspec.Struct, frozen=True, kw_only=True):
    """Migration time per kind, from what each kind moves.

    - ``workload``: the destination loads the bf16 weights (resume plus sync) and
      starts serving; moved requests re-prefill on it (the engine model charges that).
    - ``reshard``: the trainer's full state (``state_bytes_per_param`` per parameter)
      moves peer to peer; the effective bandwidth covers many links in parallel.
    - ``reboot``: save and reload the trainer state through storage, plus a restart.
    """

    workload: MigrationCost = msgspec.field(
        default_factory=lambda: MigrationCost(setup_s=3.4, bandwidth_bytes_per_s=50e9)
    )
    reshard: MigrationCost = msgspec.field(
        default_factory=lambda: MigrationCost(setup_s=0.368, bandwidth_bytes_per_s=216e9)
    )
    reboot: MigrationCost = msgspec.field(
        default_factory=lambda: MigrationCost(setup_s=30.0, bandwidth_bytes_per_s=10e9)
    )
    state_bytes_per_param: int = 16

    def bytes_moved(self, kind: MigrationKind, model: ModelProfile) -> int:
        """What a ``kind`` migration of ``model`` moves."""
        if kind == "workload":
            return model.weight_bytes
        return model.num_params * self.state_bytes_per_param

    def time_s(self, kind: MigrationKind, model: ModelProfile) -> float:
        """Seconds of one ``kind`` migration of ``model``."""
        return self.cost(kind).time_s(self.bytes_moved(kind, model))

    def move_time_s(
        self,
        kind: MigrationKind,
        src: ComponentKind | None,
        dst: ComponentKind | None,
        model: ModelProfile,
    ) -> float:
        """Seconds of one migration from a ``src`` component to a ``dst`` one (``None``:
        the free pool). The source releases its devices first (the trainer reshards
        its state onto the ranks it keeps; an engine just stops), then the destination
        brings them up (an engine or inference replica loads the weights; the trainer
        reshards onto its new ranks). A reboot pays the reboot cost."""
        if kind == "reboot":
            return self.time_s("reboot", model)
        release = self.time_s("reshard", model) if src == "actor" else 0.0
        if dst == "actor":
            acquire = self.time_s("reshard", model)
        elif dst is not None:
            acquire = self.time_s("workload", model)
        else:
            acquire = 0.0
        return release + acquire

    def cost(self, kind: MigrationKind) -> MigrationCost:
        """The cost parameters of ``kind``."""
        return {"workload": self.workload, "reshard": self.reshard, "reboot": self.reboot}[kind]
