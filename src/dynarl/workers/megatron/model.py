"""Megatron-core GPT models of the Qwen2 and Llama families, from their Hugging Face
configs.

:class:`Architecture` is what this backend reads from a ``transformers`` config (and
refuses, naming the field, what it cannot reproduce exactly: rope scaling, sliding
windows, dropout, biases beyond Qwen2's q/k/v bias); :func:`build_gpt` makes the
``GPTModel`` of one pipeline stage and tensor-parallel rank with megatron-core's local
layer spec (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, q/k/v bias for
Qwen2, tied embeddings where the config says so), fp32 or bf16, every fusion off, on
the process groups it is given (no ``parallel_state`` globals, so groups can be rebuilt
when the trainer resizes).

:func:`causal_logits` runs it the way a causal LM is called on right-padded rows: an
explicit causal mask, logits ``[batch, seq, vocab]`` cut to the real vocabulary (the
embedding is padded to a multiple of the tensor-parallel size).
"""

import copy
import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from dynarl.core.errors import ConfigError
from dynarl.workers.megatron.cpu import quiet, use_cpu

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen2 or Llama model, as both frameworks need it.

    Attributes:
        family: ``qwen2`` (q/k/v bias) or ``llama``.
        vocab_size: the checkpoint's vocabulary (the HF embedding's rows).
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_hidden_size:
            transformer shape.
        rms_norm_eps, rope_theta: RMSNorm epsilon and rotary base.
        qkv_bias: q/k/v projections have a bias.
        tied_embeddings: the output layer is the input embedding. Split over more than
            one pipeline stage, the last stage keeps its own copy of the embedding as
            its output layer (loaded from the same HF tensor), and the trainer sums the
            two copies' gradients over the embedding group before each step, so they
            stay equal.
        max_positions: longest sequence.
        dtype: ``float32`` or ``bfloat16``.
        padding_idx: the embedding row of the config's ``pad_token_id`` (``None``:
            none). ``transformers`` builds its input embedding with
            ``nn.Embedding(padding_idx=...)``, whose lookups of that row pass no
            gradient (the row never trains, even where the pad token is a real token:
            one a policy sampled, or the EOS of a tokenizer whose pad is its EOS); the
            Megatron model does the same (:func:`build_gpt`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tied_embeddings: bool
    max_positions: int
    dtype: str = "float32"
    padding_idx: int | None = None

    @classmethod
    def from_hf_config(cls, config: Any) -> "Architecture":
        """The architecture of a ``transformers`` ``Qwen2Config`` or ``LlamaConfig``.

        Raises:
            ConfigError: another family, or a setting this backend cannot reproduce.
        """
        family = getattr(config, "model_type", "")
        if family not in ("qwen2", "llama"):
            raise ConfigError(
                f"model_type={family!r}: the megatron backend builds qwen2 and llama models; "
                "use actor.backend=torch for other architectures",
                field="model.path",
            )
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        _refuse(rope_type not in ("default", None), f"rope_type={rope_type!r} (rope scaling)")
        _refuse(bool(getattr(config, "use_sliding_window", False)), "use_sliding_window=True")
        _refuse(float(getattr(config, "attention_dropout", 0.0)) != 0.0, "attention_dropout > 0")
        _refuse(getattr(config, "hidden_act", "silu") != "silu", f"hidden_act={config.hidden_act}")
        _refuse(bool(getattr(config, "mlp_bias", False)), "mlp_bias=True")
        _refuse(
            family == "llama" and bool(getattr(config, "attention_bias", False)),
            "attention_bias=True (a bias on o_proj too)",
        )
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        vocab = int(config.vocab_size)
        pad = getattr(config, "pad_token_id", None)
        return cls(
            family=family,
            vocab_size=vocab,
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            qkv_bias=family == "qwen2",
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=int(config.max_position_embeddings),
            dtype=_DTYPES.get(dtype, "float32"),
            padding_idx=None if pad is None else int(pad) % vocab,  # negative: from the end
        )

    def padded_vocab_size(self, tp: int) -> int:
        """Embedding rows when sharded ``tp`` ways (a multiple of ``tp``; the extra
        rows stay zero and their logits are cut off)."""
        return -(-self.vocab_size // tp) * tp

    def check_parallel(self, tp: int, pp: int) -> None:
        """Refuse tensor- and pipeline-parallel sizes this model cannot be split into."""
        if self.num_kv_heads % tp or self.num_heads % tp:
            raise ConfigError(
                f"actor.tp={tp} must divide the model's {self.num_heads} attention heads and "
                f"{self.num_kv_heads} key/value heads; pick a divisor",
                field="actor.tp",
            )
        if self.ffn_hidden_size % tp:
            raise ConfigError(
                f"actor.tp={tp} must divide the MLP width {self.ffn_hidden_size}",
                field="actor.tp",
            )
        if self.num_layers % pp:
            raise ConfigError(
                f"actor.pp={pp} must divide the model's {self.num_layers} layers",
                field="actor.pp",
            )


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise ConfigError(
            f"the model config has {what}, which the megatron backend does not reproduce; "
            "use the torch backend for this model",
            field="model.path",
        )


def transformer_config(arch: Architecture, *, tp: int = 1, pp: int = 1) -> Any:
    """megatron-core's ``TransformerConfig`` for ``arch`` split ``tp`` x ``pp`` ways:
    fp32/bf16, CPU initialisation without random init (weights are loaded), no dropout,
    no fusions (exact on the CPU and the same maths on a GPU)."""
    with quiet():
        from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = getattr(torch, arch.dtype)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        cuda_graph_scope=[],
        calculate_per_token_loss=True,
    )


def preload() -> None:
    """Import the megatron-core modules a trainer rank is built from (about 2 s of one
    CPU core), quietly: a worker does it when it joins, so the resize that first makes
    it a member does not."""
    with quiet():
        import megatron.core.distributed
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.models.gpt.gpt_model
        import megatron.core.optimizer
        import megatron.core.pipeline_parallel.schedules  # noqa: F401


def build_gpt(
    arch: Architecture,
    groups: "ProcessGroupCollection",
    *,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """The ``GPTModel`` of this process's tensor-parallel rank and pipeline stage (both
    read from ``groups.tp`` and ``groups.pp``), with uninitialised weights on
    ``device`` (load them with :mod:`~dynarl.workers.megatron.convert`)."""
    use_cpu(force=torch.device(device).type == "cpu")
    _ensure_memory_buffer()
    _ensure_rng_tracker()
    tp, pp = groups.tp.size(), groups.pp.size()
    arch.check_parallel(tp, pp)
    with quiet():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        stage = groups.pp.rank()
        # Without an embedding group megatron-core skips its all-reduce of a tied
        # embedding's two copies at construction (uninitialised memory here: weights are
        # loaded after), so a worker builds its rank without waiting for the other
        # stage's (a joiner of a resize). The trainer sums their gradients itself.
        building = copy.copy(groups)
        building.embd = None
        model = GPTModel(
            transformer_config(arch, tp=tp, pp=pp),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=arch.padded_vocab_size(tp),
            max_sequence_length=arch.max_positions,
            pre_process=stage == 0,
            post_process=stage == pp - 1,
            parallel_output=False,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            pg_collection=building,
        )
    model.pg_collection = groups
    model.embd_group = groups.embd
    module: torch.nn.Module = model
    _mark_sharded(module)
    if stage == 0 and arch.padding_idx is not None:
        _no_gradient_through(model.embedding.word_embeddings, arch.padding_idx)
    if device != "cpu":
        module.to(device)
    return module


def _no_gradient_through(embedding: torch.nn.Module, token: int) -> None:
    """Make ``embedding``'s lookups of ``token`` pass no gradient, as
    ``nn.Embedding(padding_idx=token)`` does: its output there is detached, so the
    forward is unchanged and the row learns nothing through the input (a tied output
    layer still trains it, as in ``transformers``)."""

    def hook(
        module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:
        where = inputs[0].eq(token).unsqueeze(-1)
        return torch.where(where, output.detach(), output)

    embedding.register_forward_hook(hook)


def _mark_sharded(model: torch.nn.Module) -> None:
    """Mark every tensor-parallel-split parameter as megatron-core's initialisation
    would (it is skipped here: weights are loaded), so gradient norms count the norms'
    replicated weights once and every shard of the others."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or getattr(param, "tensor_model_parallel", False):
            continue
        dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's attention mask (``True`` = not attended, ``[batch, 1, seq, seq]``)
    for right-padded rows whose real tokens are ``attention_mask == 1``: causal, and
    no query attends to padding."""
    width = attention_mask.shape[1]
    future = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).triu(1)
    padding = (attention_mask == 0)[:, None, None, :]
    return future[None, None] | padding


def causal_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    vocab_size: int,
) -> torch.Tensor:
    """Logits ``[batch, seq, vocab_size]`` of a single-stage ``model`` (every layer
    here) on right-padded ``input_ids``."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    logits: torch.Tensor = model(input_ids, positions, causal_mask(attention_mask))
    return logits[..., :vocab_size]


def single_process_groups() -> "ProcessGroupCollection":
    """Process groups of one rank for every parallel dimension (inference and tests in
    one process). Joins a world of one, in memory, when this process has none yet."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    group = dist.new_group([dist.get_rank()])
    return groups_of(tp=group, pp=group, dp=group)


def groups_of(
    *,
    tp: dist.ProcessGroup,
    pp: dist.ProcessGroup,
    dp: dist.ProcessGroup,
    mp: dist.ProcessGroup | None = None,
    embd: dist.ProcessGroup | None = None,
    single: dist.ProcessGroup | None = None,
) -> "ProcessGroupCollection":
    """A ``ProcessGroupCollection`` of the given groups (context and expert parallel
    sizes are 1: their groups are ``single``, this rank alone, or the tensor-parallel
    group where it has one rank; ``embd``: the pipeline's first and last stage on
    those stages, else ``None``; no position embedding group, the models use rotary
    embeddings)."""
    with quiet():
        from megatron.core.process_groups_config import ProcessGroupCollection
    groups = ProcessGroupCollection()
    groups.tp = tp
    groups.pp = pp
    groups.dp = dp
    groups.dp_cp = dp
    alone = _alone(tp, single)
    groups.cp = alone
    groups.tp_cp = tp
    groups.mp = mp if mp is not None else tp
    groups.embd = embd
    groups.pos_embd = None
    groups.tp_dp_cp = dp if tp.size() == 1 else tp
    groups.expt_dp = dp
    groups.ep = alone
    groups.expt_tp = tp
    groups.tp_ep = tp
    groups.tp_ep_pp = groups.mp
    return groups


def _alone(tp: dist.ProcessGroup, single: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A group of this rank alone: ``tp`` when it has one rank, else ``single``."""
    if tp.size() == 1:
        return tp
    if single is None:
        raise ValueError("a tensor-parallel rank needs the group of itself alone (single)")
    return single


def _ensure_rng_tracker() -> None:
    """The inference RNG tracker (``fork`` touches no RNG), unless one is installed:
    exact for these dropout-free models, on the CPU and on a GPU."""
    from megatron.core.tensor_parallel import random

    if not random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        random.initialize_rng_tracker(inference_rng_tracker=True)


def _ensure_memory_buffer() -> None:
    """Attention's scratch buffer, a process-wide megatron-core object."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
