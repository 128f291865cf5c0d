"""Model shapes, and the byte and FLOP counts that follow from them.

Only dense decoder-only transformers with grouped-query attention and a gated MLP
(Qwen2 family) are modelled; that covers the reference experiments.
"""

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from dynarl.sim.errors import SimError


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True):
    """A transformer's shape.

    Attributes:
        name: table key, e.g. ``"R1-Distill-Qwen-7B"``.
        num_layers: decoder layers.
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        vocab_size: embedding rows.
        intermediate_size: MLP width (gate, up and down projections).
        tie_embeddings: the output head shares the input embedding.
        bytes_per_param: 2 for bf16 weights.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int
    tie_embeddings: bool = False
    bytes_per_param: int = 2

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (attention with q/k/v biases, MLP, norms)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    @property
    def num_params(self) -> int:
        """All parameters (embedding, layers, final norm, output head unless tied)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embedding
        return embedding + head + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights (what a rollout engine holds and weight sync moves)."""
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of context occupies (all layers, keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def matmul_params(self) -> int:
        """Parameters touched by matrix multiplies per token (all but the embedding
        lookup, which is a gather)."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    def forward_flops_per_token(self, context_tokens: float = 0.0) -> float:
        """Forward FLOPs for one token attending to ``context_tokens`` earlier tokens
        (2 per multiply-add in the matmuls, plus QK^T and AV over the context)."""
        attention = 4.0 * self.num_layers * self.num_heads * self.head_dim * context_tokens
        return 2.0 * self.matmul_params + attention

    def prefill_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Forward FLOPs to prefill ``new_tokens`` after ``cached_tokens`` already in the
        KV cache (each new token attends to everything before it)."""
        mean_context = cached_tokens + new_tokens / 2.0
        return new_tokens * self.forward_flops_per_token(mean_context)

    def train_flops_per_token(self, context_tokens: float = 0.0) -> float:
        """Forward plus backward FLOPs for one trained token (3x forward)."""
        return 3.0 * self.forward_flops_per_token(context_tokens)


def _qwen(
    name: str, *, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, tie: bool
) -> ModelProfile:
    return ModelProfile(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=vocab,
        intermediate_size=inter,
        tie_embeddings=tie,
    )


# Shapes from the models' published config.json files. The R1 distills reuse the Qwen2.5
# (Math) shapes; the 1.5B distill unties its output head.
MODELS: Mapping[str, ModelProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            _qwen(
                "Qwen2.5-1.5B",
                layers=28,
                hidden=1536,
                heads=12,
                kv=2,
                inter=8960,
                vocab=151936,
                tie=True,
            ),
            _qwen(
                "Qwen2.5-7B",
                layers=28,
                hidden=3584,
                heads=28,
                kv=4,
                inter=18944,
                vocab=152064,
                tie=False,
            ),
            _qwen(
                "Qwen2.5-32B",
                layers=64,
                hidden=5120,
                heads=40,
                kv=8,
                inter=27648,
                vocab=152064,
                tie=False,
            ),
            _qwen(
                "R1-Distill-Qwen-1.5B",
                layers=28,
                hidden=1536,
                heads=12,
                kv=2,
                inter=8960,
                vocab=151936,
                tie=False,
            ),
            _qwen(
                "R1-Distill-Qwen-7B",
                layers=28,
                hidden=3584,
                heads=28,
                kv=4,
                inter=18944,
                vocab=152064,
                tie=False,
            ),
            _qwen(
                "R1-Distill-Qwen-32B",
                layers=64,
                hidden=5120,
                heads=40,
                kv=8,
                inter=27648,
                vocab=152064,
                tie=False,
            ),
        )
    }
)
"""Built-in model shapes by name."""


def model(name: str) -> ModelProfile:
    """The built-in model shape called ``name`` (case-insensitive).

    Raises:
        SimError: no such model; the message lists the known ones.
    """
    for key, profile in MODELS.items():
        if key.lower() == name.lower():
            return profile
    raise SimError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or build a ModelProfile)")
