"""The configuration tree of a run: frozen, kw-only ``msgspec.Struct``s, one section
per component.

Each component owns its section beside its code and receives only that section:
:class:`~dynarl.launch.config.ClusterConfig`, :class:`~dynarl.workers.config.ModelConfig`,
:class:`~dynarl.workers.config.RolloutConfig`,
:class:`~dynarl.workers.config.InferenceConfig`,
:class:`~dynarl.workers.config.ActorConfig`, :class:`~dynarl.rl.config.AlgorithmConfig`,
:class:`~dynarl.control.config.SchedulerConfig`, :class:`~dynarl.envs.config.DataConfig`
(re-exported here), and :class:`RunConfig`. Cross-section rules (device counts, batch
divisibility) are checked when the root :class:`DynaRLConfig` is built, and a violation
raises :class:`~dynarl.ConfigError` naming the field and the fix. Files load into the
same tree through :mod:`dynarl.api.config_io`.
"""

import msgspec

from dynarl.control.config import SchedulerConfig
from dynarl.control.layout import PipelineLayout
from dynarl.core.config import NonNegativeFloat, NonNegativeInt, PositiveInt, Section
from dynarl.core.errors import ConfigError
from dynarl.envs.config import DataConfig, EnvConfig
from dynarl.launch.config import ClusterConfig
from dynarl.rl.config import AlgorithmConfig
from dynarl.workers.config import ActorConfig, InferenceConfig, ModelConfig, RolloutConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "DataConfig",
    "DynaRLConfig",
    "EnvConfig",
    "InferenceConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SchedulerConfig",
]


class RunConfig(Section, frozen=True, kw_only=True):
    """One run.

    Attributes:
        num_iterations: RL iterations to run.
        run_dir: where the run directory is written.
        seed: seed of data order, sampling and initial weights.
        checkpoint_every: iterations between checkpoints (0: only at the end).
        stall_timeout_s: seconds an iteration may go without any progress (no item
            routed or completed, no tool call, optimizer step or migration ending)
            before the run stops and says where its work stands (0: wait forever).
    """

    num_iterations: PositiveInt = 20
    run_dir: str = "runs/latest"
    seed: int = 0
    checkpoint_every: NonNegativeInt = 5
    stall_timeout_s: NonNegativeFloat = 1800.0


class DynaRLConfig(Section, frozen=True, kw_only=True):
    """The whole configuration of a run; every field has a working default."""

    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        n = self.cluster.num_devices
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
        if algo.kl_coef > 0 and not self.inference.compute_ref_logprobs:
            raise ConfigError(
                f"algorithm.kl_coef={algo.kl_coef} penalises the distance to the reference "
                "policy, whose log-probs the inference stage computes: set "
                "inference.compute_ref_logprobs=true (or algorithm.kl_coef=0)",
                field="algorithm.kl_coef",
            )
        if (
            algo.kl_coef > 0
            and self.scheduler.mode == "static-disaggregated"
            and self.inference.initial_devices == 0
        ):
            raise ConfigError(
                "algorithm.kl_coef > 0 needs reference log-probs from inference devices, "
                "and scheduler.mode=static-disaggregated keeps inference.initial_devices=0 "
                "for the whole run; give inference devices or set algorithm.kl_coef=0",
                field="inference.initial_devices",
            )
        self._check_old_logprobs()
        if (
            self.scheduler.mode == "static-disaggregated"
            and min(self.rollout.initial_devices, self.actor.initial_devices) == 0
        ):
            raise ConfigError(
                "scheduler.mode=static-disaggregated keeps the initial split for the whole "
                "run, so rollout.initial_devices and actor.initial_devices must both be > 0",
                field="scheduler.mode",
            )
        self._check_env()
        self._check_accelerator()

    def _check_accelerator(self) -> None:
        """The devices' kind agrees with what runs on them: GPUs reserved on Ray are
        used, and the weight-sync group of SGLang servers speaks the trainer's
        collective backend (gloo on CPU, NCCL on CUDA)."""
        cluster = self.cluster
        if (
            cluster.accelerator == "cpu"
            and cluster.ray.gpus_per_device > 0
            and self.rollout.backend != "sglang"
        ):
            raise ConfigError(
                f"cluster.ray.gpus_per_device={cluster.ray.gpus_per_device} reserves GPUs, "
                "but cluster.accelerator=cpu runs every worker on the CPU: set "
                "cluster.accelerator=cuda, or cluster.ray.gpus_per_device=0",
                field="cluster.accelerator",
            )
        wanted = "nccl" if cluster.accelerator == "cuda" else "gloo"
        chosen = self.rollout.sglang.weight_sync_backend
        if self.rollout.backend == "sglang" and chosen not in (None, wanted):
            raise ConfigError(
                f"rollout.sglang.weight_sync_backend={chosen!r}, but with "
                f"cluster.accelerator={cluster.accelerator} the trainer sends weights over "
                f"{wanted}: leave rollout.sglang.weight_sync_backend unset (it follows "
                f"cluster.accelerator), or set cluster.accelerator="
                f"{'cuda' if chosen == 'nccl' else 'cpu'}",
                field="rollout.sglang.weight_sync_backend",
            )
        megatron = self.actor.megatron
        if not megatron.buddy_copies and not megatron.uses_distributed_optimizer(
            cluster.accelerator
        ):
            raise ConfigError(
                "actor.megatron.buddy_copies=false turns off the distributed optimizer's "
                f"copies, but with cluster.accelerator={cluster.accelerator} the trainer "
                "runs torch's AdamW (actor.megatron.distributed_optimizer unset): set "
                "actor.megatron.distributed_optimizer=true, or drop "
                "actor.megatron.buddy_copies",
                field="actor.megatron.buddy_copies",
            )

    def _check_env(self) -> None:
        env, model = self.env, self.model
        if env.max_total_tokens is not None and env.max_total_tokens > model.max_seq_len:
            raise ConfigError(
                f"env.max_total_tokens={env.max_total_tokens} is longer than the model's "
                f"model.max_seq_len={model.max_seq_len}; lower it or leave it unset",
                field="env.max_total_tokens",
            )
        if env.name is not None and model.path is None and model.tokenizer != "chat":
            raise ConfigError(
                f"env.name={env.name!r} plays multi-turn episodes through a chat template, "
                "and the built-in character tokenizer has none; set model.tokenizer=chat",
                field="model.tokenizer",
            )
        if env.warm_start_steps and model.path is not None:
            raise ConfigError(
                "env.warm_start_steps trains a random-init policy, but model.path loads a "
                "checkpoint; set env.warm_start_steps=0 (or drop model.path)",
                field="env.warm_start_steps",
            )

    def _check_old_logprobs(self) -> None:
        """Where old log-probs come from decides whether the inference stage exists;
        refuse devices or settings it would leave unused, and a stage with no way to
        get devices."""
        source = self.algorithm.old_logprobs
        if source == "rollout" and self.inference.compute_ref_logprobs:
            raise ConfigError(
                "algorithm.old_logprobs=rollout skips the inference stage, but "
                "inference.compute_ref_logprobs=true runs it for the reference log-probs; "
                "recompute the old log-probs there too (algorithm.old_logprobs=inference)",
                field="algorithm.old_logprobs",
            )
        if source == "rollout" and self.inference.initial_devices:
            raise ConfigError(
                f"algorithm.old_logprobs=rollout leaves no work for inference, which would "
                f"hold inference.initial_devices={self.inference.initial_devices} devices "
                "idle; set inference.initial_devices=0",
                field="inference.initial_devices",
            )
        if (
            source == "inference"
            and self.scheduler.mode == "static-disaggregated"
            and self.inference.initial_devices == 0
        ):
            raise ConfigError(
                "algorithm.old_logprobs=inference recomputes old log-probs on inference "
                "devices, and scheduler.mode=static-disaggregated keeps "
                "inference.initial_devices=0 for the whole run; give inference devices, or "
                "train on the engines' own log-probs (algorithm.old_logprobs=rollout)",
                field="algorithm.old_logprobs",
            )

    @property
    def inference_forwards(self) -> int:
        """Forward passes the inference stage runs per sample: 0 (no inference stage:
        old log-probs from the engines), 1 (old log-probs), 2 (and the reference's)."""
        if self.algorithm.old_logprobs == "rollout":
            return 0
        return 2 if self.inference.compute_ref_logprobs else 1

    def pipeline_layout(self) -> PipelineLayout:
        """The pipeline the control plane models for this run: its components'
        instance sizes, initial devices and batch shape."""
        algo = self.algorithm
        return PipelineLayout(
            num_devices=self.cluster.num_devices,
            rollout_tp=self.rollout.tp,
            rollout_tail_tp=self.rollout.tail_tp,
            inference_tp=self.inference.tp,
            actor_devices_per_replica=self.actor.devices_per_replica,
            actor_initial_devices=self.actor.initial_devices,
            rollout_initial_devices=self.rollout.initial_devices,
            inference_initial_devices=self.inference.initial_devices,
            rollout_max_running=self.rollout.max_running_requests,
            max_new_tokens=self.rollout.max_new_tokens,
            actor_steps_per_iteration=algo.n_minibatches,
            actor_steps_in_arrival_order=algo.minibatch_order == "completion",
            samples_per_minibatch=algo.samples_per_minibatch,
            allow_uneven_micro_batches=self.actor.allow_uneven_micro_batches,
            u_low=self.scheduler.u_low,
            uses_inference=self.inference_forwards > 0,
        )
