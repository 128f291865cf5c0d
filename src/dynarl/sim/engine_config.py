"""What one modelled rollout engine costs: its KV capacity, decode step and prefill.

A decode step is memory-bound: ``overhead + (weight bytes / tp + KV bytes read) / HBM
bandwidth``; prefill is compute-bound at ``prefill_mfu``. Anchored to the reference:
R1-Distill-Qwen-1.5B on one H100 at batch 128 and mean context 10K takes ≈13.5 ms a
step (reference ≈12 ms), and its tail at batch 8 decodes ≈1.5–2K tokens/s.
"""

import msgspec

from dynarl.sim.errors import SimError
from dynarl.sim.hardware import GpuProfile
from dynarl.sim.models import ModelProfile


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One modelled engine: a model on ``tp`` devices of one kind.

    Attributes:
        gpu: device profile.
        model: model shape.
        tp: tensor-parallel size (devices per engine).
        max_running_requests: batch cap (SGLang ``--max-running-requests``).
        mem_fraction: share of device memory for weights plus KV cache.
        admit_fraction: admit a queued job only while held KV stays under this share of
            the capacity (headroom for growth; a lone job is always admitted).
        step_overhead_s: fixed cost of one decode step (scheduling, sampling, launch).
        step_per_request_s: extra cost of a decode step per running request (a CPU
            slot's sampling and bookkeeping in Python; 0 on a GPU, where it hides
            under the memory-bound step).
        tp_overhead_s_per_layer: extra cost per layer of a decode step when ``tp > 1``
            (the all-reduces).
        prefill_mfu: achieved share of peak FLOP/s during prefill.
        prefill_overhead_s: fixed cost of one prefill batch.
        padded_kv: the running batch's KV is one left-padded cache (the reference
            torch engine): a decode step reads every row at the longest row's width,
            not just the context held (paged engines such as SGLang: ``False``).
        join_per_held_token_s: extra cost of a prefill into a running batch per token
            of KV the batch holds (as :attr:`padded_kv` counts them): a cache that is
            rebuilt when rows join; 0 for a paged cache.
        leave_per_held_token_s: cost of rows leaving the running batch (after a step
            in which some finished) per token of KV the rest hold; 0 for a paged cache.
        kv_capacity_tokens: override of the KV capacity derived from memory (0: derive).
        retract_headroom_steps: when the cache overflows, retract running jobs until
            the rest can decode this many steps (SGLang's retract decode, with a wider
            margin so that retractions stay rare).
        init_new_token_ratio: share of a running job's future tokens (clipped at
            ``new_token_clip``) that admission reserves KV for (SGLang's
            ``new_token_ratio``); a retraction raises it to 1, and it falls back by
            ``(init - min) / new_token_ratio_decay_steps`` a step to ``min_new_token_ratio``.
        min_new_token_ratio: the floor of that share.
        new_token_ratio_decay_steps: steps to decay from the initial ratio to the floor.
        new_token_clip: cap on the future tokens reserved per job (SGLang's
            ``CLIP_MAX_NEW_TOKENS``).
    """

    gpu: GpuProfile
    model: ModelProfile
    tp: int = 1
    max_running_requests: int = 128
    mem_fraction: float = 0.85
    admit_fraction: float = 0.9
    step_overhead_s: float = 1.5e-3
    step_per_request_s: float = 0.0
    tp_overhead_s_per_layer: float = 15e-6
    prefill_mfu: float = 0.5
    prefill_overhead_s: float = 5e-3
    padded_kv: bool = False
    join_per_held_token_s: float = 0.0
    leave_per_held_token_s: float = 0.0
    kv_capacity_tokens: int = 0
    retract_headroom_steps: int = 256
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    new_token_clip: int = 4096

    @property
    def kv_tokens_capacity(self) -> int:
        """Tokens of context the engine's KV cache holds."""
        if self.kv_capacity_tokens:
            return self.kv_capacity_tokens
        per_device = self.gpu.memory_bytes * self.mem_fraction - self.model.weight_bytes / self.tp
        kv_per_device = self.model.kv_bytes_per_token / min(self.tp, self.model.num_kv_heads)
        capacity = int(per_device // kv_per_device)
        if capacity <= 0:
            raise SimError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name} at "
                f"mem_fraction={self.mem_fraction}; raise tp"
            )
        return capacity

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode step for ``batch`` requests holding ``context_tokens``
        tokens of context in all."""
        a, b = self.step_coefficients()
        return a + self.step_per_request_s * batch + b * context_tokens if batch else 0.0

    def step_coefficients(self) -> tuple[float, float]:
        """``(a, b)``: a decode step costs ``a + b * context tokens read`` (plus
        :attr:`step_per_request_s` per running request)."""
        hbm = self.gpu.hbm_bytes_per_s
        a = self.step_overhead_s + self.model.weight_bytes / self.tp / hbm
        if self.tp > 1:
            a += self.tp_overhead_s_per_layer * self.model.num_layers
        b = self.model.kv_bytes_per_token / min(self.tp, self.model.num_kv_heads) / hbm
        return a, b

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Compute time to prefill ``new_tokens`` after ``cached_tokens``, without the
        batch overhead."""
        flops = self.model.prefill_flops(new_tokens, cached_tokens)
        return flops / (self.tp * self.gpu.bf16_flops_per_s * self.prefill_mfu)
