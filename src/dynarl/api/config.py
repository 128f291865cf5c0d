"""The configuration tree: frozen, kw-only ``msgspec.Struct``s, one section per component.

Each component receives only its own section. Cross-section rules (device counts, batch
divisibility) are checked when the root :class:`DynaRLConfig` is built, and a violation
raises :class:`~dynarl.ConfigError` naming the field and the fix. Files load into the
same tree through :mod:`dynarl.api.config_io`.
"""

from typing import Annotated, Literal

import msgspec

from dynarl.control.config import SchedulerConfig
from dynarl.core.errors import ConfigError
from dynarl.sim.config import SimConfig

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, keyword-only, unknown keys rejected."""


class ClusterConfig(_Section, frozen=True, kw_only=True):
    """Devices and where workers run.

    Attributes:
        num_devices: accelerators in the job (on CPU: device slots, one process each).
        num_nodes: machines the devices are spread over (evenly).
        threads_per_device: torch threads per CPU device slot.
        launcher: ``local`` (worker subprocesses here) or ``ray`` (Ray actors).
    """

    num_devices: PositiveInt = 4
    num_nodes: PositiveInt = 1
    threads_per_device: PositiveInt = 1
    launcher: Literal["local", "ray"] = "local"


class ModelConfig(_Section, frozen=True, kw_only=True):
    """The policy model: a local checkpoint, or a random-init architecture.

    Attributes:
        path: a local directory ``transformers`` can load (weights and tokenizer);
            when unset, a model is built from the fields below with random weights.
        arch: architecture family for random init.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: shape for
            random init.
        max_seq_len: longest prompt + response the model handles.
        dtype: parameter dtype.
    """

    path: str | None = None
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: PositiveInt = 64
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 128
    max_seq_len: PositiveInt = 256
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be a multiple of "
                f"model.num_heads={self.num_heads}",
                field="model.hidden_size",
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must be a multiple of "
                f"model.num_kv_heads={self.num_kv_heads}",
                field="model.num_kv_heads",
            )


class RolloutConfig(_Section, frozen=True, kw_only=True):
    """Rollout engines.

    Attributes:
        backend: ``torch`` (reference engine) or ``sglang``.
        tp: devices per engine (tensor parallel).
        initial_devices: devices rollout starts each run with.
        max_running_requests: requests an engine decodes at once.
        kv_capacity_tokens: KV-cache tokens an engine holds.
        temperature, top_p, max_new_tokens: sampling parameters.
    """

    backend: Literal["torch", "sglang"] = "torch"
    tp: PositiveInt = 1
    initial_devices: NonNegativeInt = 2
    max_running_requests: PositiveInt = 64
    kv_capacity_tokens: PositiveInt = 16384
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: PositiveInt = 128


class InferenceConfig(_Section, frozen=True, kw_only=True):
    """Log-probability inference (old policy, optionally a frozen reference).

    Attributes:
        backend: ``torch`` or ``megatron``.
        tp: devices per inference replica.
        initial_devices: devices inference starts with.
        micro_batch_size: sequences per forward pass.
        compute_ref_logprobs: also compute reference-model log-probs (for a KL term).
    """

    backend: Literal["torch", "megatron"] = "torch"
    tp: PositiveInt = 1
    initial_devices: NonNegativeInt = 1
    micro_batch_size: PositiveInt = 16
    compute_ref_logprobs: bool = False


class ActorConfig(_Section, frozen=True, kw_only=True):
    """The trainer.

    Attributes:
        backend: ``torch`` (DDP over gloo/NCCL) or ``megatron``.
        tp, pp: tensor and pipeline parallel size of one data-parallel replica.
        initial_devices: devices the actor starts with (a multiple of ``tp * pp``).
        micro_batch_size: sequences per forward/backward.
        lr, weight_decay, grad_clip: optimizer settings (AdamW).
        allow_uneven_micro_batches: let ranks take uneven micro-batch counts, so any
            data-parallel size is valid (otherwise it must divide the minibatch).
    """

    backend: Literal["torch", "megatron"] = "torch"
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    initial_devices: NonNegativeInt = 1
    micro_batch_size: PositiveInt = 32
    lr: PositiveFloat = 3e-3
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    grad_clip: PositiveFloat = 1.0
    allow_uneven_micro_batches: bool = False

    @property
    def devices_per_replica(self) -> int:
        """Devices one data-parallel replica takes."""
        return self.tp * self.pp


class AlgorithmConfig(_Section, frozen=True, kw_only=True):
    """The RL algorithm.

    Attributes:
        name: ``grpo`` (group-normalised advantages) or ``ppo``.
        num_prompts: prompts per iteration.
        group_size: responses sampled per prompt (G).
        n_minibatches: optimizer steps per iteration.
        clip_eps: PPO clip range of the importance ratio.
        kl_coef: weight of the KL penalty to the reference policy (0 disables it).
        loss_agg: ``token-mean`` or ``seq-mean`` loss aggregation.
        minibatch_order: ``seeded``: the iteration's samples are split into minibatches
            by a seeded permutation once every response is in (the same split in every
            scheduling mode, so modes learn exactly the same); ``completion``: whole
            groups form minibatches in the order they finish, and the actor takes its
            first optimizer steps while the rollout tail still runs (PPO on the same
            behaviour policy, in another data order; needs ``num_prompts`` divisible
            by ``n_minibatches``).
    """

    name: Literal["grpo", "ppo"] = "grpo"
    num_prompts: PositiveInt = 16
    group_size: PositiveInt = 4
    n_minibatches: PositiveInt = 2
    clip_eps: PositiveFloat = 0.2
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    minibatch_order: Literal["seeded", "completion"] = "seeded"

    def __post_init__(self) -> None:
        if self.minibatch_order == "completion" and self.num_prompts % self.n_minibatches:
            raise ConfigError(
                f"algorithm.minibatch_order=completion forms minibatches of whole groups, "
                f"so num_prompts ({self.num_prompts}) must be a multiple of n_minibatches "
                f"({self.n_minibatches}); change one of them or use minibatch_order=seeded",
                field="algorithm.minibatch_order",
            )

    @property
    def samples_per_iteration(self) -> int:
        """Sequences generated per iteration."""
        return self.num_prompts * self.group_size

    @property
    def samples_per_minibatch(self) -> int:
        """Sequences per optimizer step."""
        return self.samples_per_iteration // self.n_minibatches


class DataConfig(_Section, frozen=True, kw_only=True):
    """Where prompts come from.

    Attributes:
        source: ``synthetic`` (the built-in task) or ``file``.
        path: JSONL or Parquet file of prompts when ``source`` is ``file``.
        shuffle: shuffle prompts each epoch (seeded by ``run.seed``).
    """

    source: Literal["synthetic", "file"] = "synthetic"
    path: str | None = None
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.source == "file" and not self.path:
            raise ConfigError(
                "data.source=file needs data.path (a JSONL or Parquet file of prompts)",
                field="data.path",
            )


class RunConfig(_Section, frozen=True, kw_only=True):
    """One run.

    Attributes:
        num_iterations: RL iterations to run.
        run_dir: where the run directory is written.
        seed: seed of data order, sampling and initial weights.
        checkpoint_every: iterations between checkpoints (0: only at the end).
    """

    num_iterations: PositiveInt = 20
    run_dir: str = "runs/latest"
    seed: int = 0
    checkpoint_every: NonNegativeInt = 5


class DynaRLConfig(_Section, frozen=True, kw_only=True):
    """The whole configuration of a run; every field has a working default."""

    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    sim: SimConfig = msgspec.field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        n = self.cluster.num_devices
        if n % self.cluster.num_nodes:
            raise ConfigError(
                f"cluster.num_devices={n} must split evenly over "
                f"cluster.num_nodes={self.cluster.num_nodes}",
                field="cluster.num_devices",
            )
        for name, initial, unit in (
            ("rollout", self.rollout.initial_devices, self.rollout.tp),
            ("inference", self.inference.initial_devices, self.inference.tp),
            ("actor", self.actor.initial_devices, self.actor.devices_per_replica),
        ):
            if initial % unit:
                raise ConfigError(
                    f"{name}.initial_devices={initial} must be a multiple of the "
                    f"{name} instance size {unit}",
                    field=f"{name}.initial_devices",
                )
        used = (
            self.rollout.initial_devices
            + self.inference.initial_devices
            + self.actor.initial_devices
        )
        if used > n:
            raise ConfigError(
                f"rollout, inference and actor start with {used} devices but "
                f"cluster.num_devices={n}; lower their initial_devices or add devices",
                field="cluster.num_devices",
            )
        algo = self.algorithm
        if algo.samples_per_iteration % algo.n_minibatches:
            raise ConfigError(
                f"algorithm.n_minibatches={algo.n_minibatches} must divide the "
                f"{algo.samples_per_iteration} samples of an iteration "
                f"(num_prompts x group_size)",
                field="algorithm.n_minibatches",
            )
        replicas = self.actor.initial_devices // self.actor.devices_per_replica
        if (
            replicas
            and not self.actor.allow_uneven_micro_batches
            and algo.samples_per_minibatch % replicas
        ):
            raise ConfigError(
                f"the actor starts with {replicas} data-parallel replicas, which does not "
                f"divide the {algo.samples_per_minibatch} samples of a minibatch; change "
                f"actor.initial_devices or set actor.allow_uneven_micro_batches=true",
                field="actor.initial_devices",
            )
        if (
            self.scheduler.mode == "static-disaggregated"
            and min(self.rollout.initial_devices, self.actor.initial_devices) == 0
        ):
            raise ConfigError(
                "scheduler.mode=static-disaggregated keeps the initial split for the whole "
                "run, so rollout.initial_devices and actor.initial_devices must both be > 0",
                field="scheduler.mode",
            )
