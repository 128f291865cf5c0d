"""The worker roles' sections of the configuration: the policy model, rollout
engines, log-prob inference and the trainer (actor).

Each section names its backend (``backend``), an implementation chosen from
:mod:`dynarl.workers.backends` when a run starts; what a backend cannot do with a
section's values (a tensor-parallel size the torch engine does not shard, say) is
refused there, with the fix, never silently ignored.
"""

from typing import Annotated, Literal

import msgspec

from dynarl.core.config import NonNegativeInt, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError
from dynarl.data.peers import Balance
from dynarl.workers.sglang.config import SGLangConfig

SLOT_CAPACITY = 256
"""Items of the data router a worker slot serves at once (it says so at hello): a
rollout engine holds those beyond its running batch in a queue of its own."""


class ModelConfig(Section, frozen=True, kw_only=True):
    """The policy model: a local checkpoint, or a random-init architecture.

    Attributes:
        path: a local directory ``transformers`` can load (weights and tokenizer);
            when unset, a model is built from the fields below with random weights.
        arch: architecture family for random init.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: shape for
            random init.
        max_seq_len: longest prompt + response the model handles.
        dtype: parameter dtype.
        tokenizer: the tokenizer built in code when there is no ``path``: ``chars``
            (one token per printable character; what unset means) or ``chat`` (the same
            with Qwen's chat and tool-call special tokens and a ChatML chat template,
            for multi-turn environments). A checkpoint brings its own tokenizer: leave
            it unset with ``path``.
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
    tokenizer: Literal["chars", "chat"] | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.tokenizer is not None:
            raise ConfigError(
                f"model.tokenizer={self.tokenizer!r} builds a tokenizer for a random-init "
                f"model, but model.path={self.path!r} brings its own; drop model.tokenizer "
                f"(on the command line: --set model.tokenizer=null)",
                field="model.tokenizer",
            )
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


class RolloutConfig(Section, frozen=True, kw_only=True):
    """Rollout engines.

    Attributes:
        backend: ``torch`` (the reference engine; one device per engine) or ``sglang``
            (SGLang servers over their HTTP API; see ``sglang``).
        tp: devices per engine (tensor parallel).
        tail_tp: devices per engine the dynamic scheduler may regroup the engines
            into for the rollout's tail (0: never; else a multiple of ``tp``): a
            decode step's fixed part (the weights read, split ``tp`` ways) is most of a
            thin batch's time, so wider engines end the longest responses sooner, while
            narrow ones yield more tokens per device at full batch. The scheduler
            regroups every engine at once, when its predictor says the rollout ends
            sooner for it (re-prefills and the move included); engines return to
            ``tp`` when the rollout next starts. The simulator models it; the
            SGLang backend regroups the servers it launches (a slot keeps a server
            of each size, the unused one asleep; docs/sglang.md); the torch backend
            runs each engine on one device and refuses it.
        initial_devices: devices rollout starts each run with.
        max_running_requests: requests an engine decodes at once.
        kv_capacity_tokens: KV-cache tokens an engine of ``tp`` devices holds (one
            of ``tail_tp`` holds as many per device).
        temperature, top_p, max_new_tokens: sampling parameters.
        request_order: the order each engine's queue serves requests in: ``fifo``, or
            ``priority`` (the priority-aware queue for multi-turn episodes: sessions
            with more completed tool calls first, then a longer cached prefix, with an
            aging bound so nothing starves).
        balance: how the data router spreads requests over the engines beyond routing
            each to the least loaded: ``below_share`` (an engine that joins, or gets
            results back while it holds less than its fair share of what all run at
            once, takes its share of what the others hold: queued requests, then ones
            asked back -- waiting in another engine's queue, or running, with their
            partial output, re-prefilled; in the tail, running ones only for an engine
            short of its share by more than the share's square root, and each at most
            once), ``on_join`` (only
            an engine that joins or resumes), or ``none`` (an engine with a free slot
            takes only requests waiting beyond another's slots). Sessions
            whose KV prefix their engine holds never move. Inference replicas follow the
            same rule with their queued samples.
        sglang: the SGLang servers (``backend="sglang"``): launched or attached to.
    """

    backend: Literal["torch", "sglang"] = "torch"
    tp: PositiveInt = 1
    tail_tp: NonNegativeInt = 0
    initial_devices: NonNegativeInt = 2
    max_running_requests: PositiveInt = 64
    kv_capacity_tokens: PositiveInt = 16384
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: PositiveInt = 128
    request_order: Literal["fifo", "priority"] = "fifo"
    balance: Balance = "below_share"
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)

    def __post_init__(self) -> None:
        if self.tail_tp and (self.tail_tp <= self.tp or self.tail_tp % self.tp):
            raise ConfigError(
                f"rollout.tail_tp={self.tail_tp} must be a multiple of rollout.tp="
                f"{self.tp} larger than it (the tail's engines regroup whole ones), or 0 "
                f"to keep every engine at rollout.tp; e.g. rollout.tail_tp={2 * self.tp}",
                field="rollout.tail_tp",
            )


class InferenceConfig(Section, frozen=True, kw_only=True):
    """Log-probability inference (old policy, optionally a frozen reference).

    Attributes:
        backend: ``torch`` (one device per replica) or ``megatron`` (log-probs through
            megatron-core's forward; one process per replica, ``tp=1``; needs the
            ``megatron`` extra).
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


class MegatronActorConfig(Section, frozen=True, kw_only=True):
    """Settings only the megatron trainer (``actor.backend=megatron``) reads.

    Attributes:
        distributed_optimizer: train with Megatron's distributed optimizer
            (``get_megatron_optimizer``): AdamW's moments (and a bf16 model's fp32 main
            parameters) are sliced over the data-parallel group, gradients are
            reduce-scattered and parameters all-gathered; the update equals torch's
            AdamW's (fp32 tolerance). Off: torch's AdamW on every data-parallel rank.
            Resizes and checkpoints carry the state whole either way. Unset: on with
            ``cluster.accelerator=cuda`` (what Megatron does on GPUs), off on CPU.
        buddy_copies: with the distributed optimizer, each data-parallel rank keeps a
            copy of the next rank's optimizer slice in host memory, taken at every
            step boundary, so the trainer survives a lost rank (unless its buddy dies
            too). It costs host memory (about 6/dp fp32 values per parameter of the
            rank's shard, twice that while a boundary is committed: ~21 GB per rank
            for 7B parameters at dp = 8) and one slice-sized send per step (see
            docs/faults.md). Off: a lost rank stops the run, which resumes from its
            last checkpoint. Only read with the distributed optimizer.
    """

    distributed_optimizer: bool | None = None
    buddy_copies: bool = True

    def __post_init__(self) -> None:
        if not self.buddy_copies and self.distributed_optimizer is False:
            raise ConfigError(
                "actor.megatron.buddy_copies=false turns off the distributed optimizer's "
                "copies, but actor.megatron.distributed_optimizer=false keeps the whole "
                "optimizer state on every rank; drop actor.megatron.buddy_copies",
                field="actor.megatron.buddy_copies",
            )

    def uses_distributed_optimizer(self, accelerator: str) -> bool:
        """Whether the trainer runs the distributed optimizer on ``accelerator``."""
        if self.distributed_optimizer is None:
            return accelerator == "cuda"
        return self.distributed_optimizer


class ActorConfig(Section, frozen=True, kw_only=True):
    """The trainer.

    Attributes:
        backend: ``torch`` (data parallel over gloo/NCCL; ``tp`` and ``pp`` must be 1)
            or ``megatron`` (megatron-core: tensor, pipeline and data parallel, elastic
            data-parallel resizes; Qwen2 and Llama models; needs the ``megatron``
            extra).
        tp, pp: tensor and pipeline parallel size of one data-parallel replica.
        initial_devices: devices the actor starts with (a multiple of ``tp * pp``).
        micro_batch_size: sequences per forward/backward.
        lr, weight_decay, grad_clip: optimizer settings (AdamW).
        allow_uneven_micro_batches: let ranks take uneven micro-batch counts, so any
            data-parallel size is valid (otherwise it must divide the minibatch).
        megatron: settings of the megatron trainer (``backend=megatron`` only).
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
    megatron: MegatronActorConfig = msgspec.field(default_factory=MegatronActorConfig)

    def __post_init__(self) -> None:
        if self.backend != "megatron" and self.megatron != MegatronActorConfig():
            raise ConfigError(
                f"actor.megatron sets the megatron trainer, but actor.backend="
                f"{self.backend!r}; set actor.backend=megatron or drop actor.megatron",
                field="actor.megatron",
            )

    @property
    def devices_per_replica(self) -> int:
        """Devices one data-parallel replica takes."""
        return self.tp * self.pp
