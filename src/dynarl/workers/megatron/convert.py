"""Weight conversion between the Hugging Face layout of a Qwen2/Llama checkpoint and
megatron-core's GPT layout, sharded over tensor- and pipeline-parallel ranks.

Megatron fuses q/k/v into ``linear_qkv`` (grouped by key/value head: each group's
query heads, then its key, then its value) and gate/up into ``linear_fc1``; it shards
column-parallel weights on dimension 0 (``linear_fc1``'s gate and up halves each), row-
parallel ones on dimension 1, and pads the vocabulary to a multiple of the
tensor-parallel size; each pipeline stage numbers its layers from 0. A model with tied
embeddings split over more than one stage has a second copy of the word embedding, the
last stage's ``output_layer.weight``: it is cut from the HF embedding, and the HF
export takes the embedding from the first stage alone (the copies are equal).

:func:`to_megatron` cuts one rank's tensors out of an HF state dict; :func:`to_hf`
merges every rank's tensors back. Both are exact (pure rearrangements), and they apply
to anything shaped like the parameters (AdamW's moments convert the same way).
"""

import re
from collections.abc import Mapping, Sequence

import torch

from dynarl.workers.megatron.model import Architecture

Tensors = Mapping[str, torch.Tensor]
"""Named tensors (a state dict, or optimizer moments keyed by parameter name)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_ROW = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def megatron_names(arch: Architecture, *, pp_rank: int, pp: int) -> list[str]:
    """The parameter names of stage ``pp_rank`` of ``pp``, in a fixed order."""
    names = ["embedding.word_embeddings.weight"] if pp_rank == 0 else []
    for local in range(arch.num_layers // pp):
        prefix = f"decoder.layers.{local}."
        names += [prefix + "input_layernorm.weight", prefix + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(prefix + "self_attention.linear_qkv.bias")
        names += [
            prefix + s
            for s in (
                "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight",
            )
        ]
    if pp_rank == pp - 1:
        names.append("decoder.final_layernorm.weight")
        if not arch.tied_embeddings or pp_rank > 0:  # tied, one stage: no output weight
            names.append("output_layer.weight")
    return names


def to_megatron(
    hf: Tensors, arch: Architecture, *, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1
) -> dict[str, torch.Tensor]:
    """The tensors of rank ``(tp_rank, pp_rank)`` from HF-layout ``hf``."""
    offset = pp_rank * (arch.num_layers // pp)
    out: dict[str, torch.Tensor] = {}
    for name in megatron_names(arch, pp_rank=pp_rank, pp=pp):
        full = _full_from_hf(hf, name, arch, offset)
        out[name] = _shard(name, full, arch, tp_rank=tp_rank, tp=tp).contiguous()
    return out


def to_hf(stages: Sequence[Sequence[Tensors]], arch: Architecture) -> dict[str, torch.Tensor]:
    """The HF-layout tensors of a model whose rank ``(tp_rank, pp_rank)`` holds
    ``stages[pp_rank][tp_rank]`` (names as :func:`megatron_names`)."""
    pp = len(stages)
    out: dict[str, torch.Tensor] = {}
    for pp_rank, shards in enumerate(stages):
        offset = pp_rank * (arch.num_layers // pp)
        for name in megatron_names(arch, pp_rank=pp_rank, pp=pp):
            full = _unshard(name, [s[name] for s in shards], arch)
            out.update(_hf_from_full(full, name, arch, offset))
    return out


def hf_names(arch: Architecture) -> list[str]:
    """The HF parameter names of ``arch`` (``named_parameters`` of its causal LM)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + "self_attn.o_proj.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not arch.tied_embeddings:
        names.append("lm_head.weight")
    return names


# -- one parameter, unsharded -------------------------------------------------------


def _full_from_hf(hf: Tensors, name: str, arch: Architecture, offset: int) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return hf["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return hf["model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    match = _LAYER.match(name)
    assert match is not None, name
    layer, rest = int(match[1]) + offset, match[2]
    p = f"model.layers.{layer}."
    if rest in _NORMS:
        return hf[p + _NORMS[rest]]
    if rest in _ROW:
        return hf[p + _ROW[rest]]
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    kind = rest.rsplit(".", 1)[1]  # weight or bias
    q, k, v = (hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
    groups, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)],
        dim=1,
    )
    return fused.reshape(-1, *tail)


def _hf_from_full(
    full: torch.Tensor, name: str, arch: Architecture, offset: int
) -> dict[str, torch.Tensor]:
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full}
    if name == "output_layer.weight":
        # a tied model's copy on the last stage equals the first stage's embedding
        return {} if arch.tied_embeddings else {"lm_head.weight": full}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    match = _LAYER.match(name)
    assert match is not None, name
    layer, rest = int(match[1]) + offset, match[2]
    p = f"model.layers.{layer}."
    if rest in _NORMS:
        return {p + _NORMS[rest]: full}
    if rest in _ROW:
        return {p + _ROW[rest]: full}
    if rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2)
        return {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    kind = rest.rsplit(".", 1)[1]
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups * d
    tail = full.shape[1:]
    q, k, v = torch.split(full.reshape(groups, per_group + 2 * d, *tail), [per_group, d, d], 1)
    return {
        p + f"self_attn.q_proj.{kind}": q.reshape(-1, *tail),
        p + f"self_attn.k_proj.{kind}": k.reshape(-1, *tail),
        p + f"self_attn.v_proj.{kind}": v.reshape(-1, *tail),
    }


# -- tensor-parallel sharding ---------------------------------------------------------


def _is_vocab(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def _shard(
    name: str, full: torch.Tensor, arch: Architecture, *, tp_rank: int, tp: int
) -> torch.Tensor:
    if _is_vocab(name):
        rows = arch.padded_vocab_size(tp)
        padded = full.new_zeros(rows, *full.shape[1:])
        padded[: full.shape[0]] = full
        return padded.chunk(tp)[tp_rank]
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return full.chunk(tp)[tp_rank]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[tp_rank]
    return full  # norms: every rank holds them whole


def _unshard(name: str, shards: Sequence[torch.Tensor], arch: Architecture) -> torch.Tensor:
    if _is_vocab(name):
        return torch.cat(list(shards))[: arch.vocab_size]
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return torch.cat(list(shards))
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(list(shards), dim=1)
    return shards[0]


def load_into(model: torch.nn.Module, tensors: Tensors) -> None:
    """Copy ``tensors`` (one rank's, from :func:`to_megatron`) into ``model``'s
    parameters of those names; every parameter must be given, with its shape."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, parameter in own.items():
            source = tensors[name]
            if source.shape != parameter.shape:
                raise ValueError(
                    f"{name}: shape {tuple(source.shape)} for a parameter of "
                    f"{tuple(parameter.shape)}"
                )
            parameter.copy_(source)
