"""Choosing next tokens from logits, with per-request temperature and top-p.

Randomness is counter-based: the uniform number behind a request's ``i``-th output token
is a hash of ``(seed, i)`` (SplitMix64), with no generator state to carry. A request
therefore samples the same tokens whatever else is in the batch and wherever it runs,
including after an abort and a resume on another engine; only logits differing in the
last bits (different batch shapes) can move a draw that falls on a boundary.

The log-prob reported for a token is under the model's own distribution,
``log_softmax(logits)``: temperature and top-p shape the choice, not the reported
log-prob, so it matches a teacher-forced forward of the same tokens.
"""

import torch

_MASK_64 = (1 << 64) - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15


def uniform(seed: int, index: int) -> float:
    """A uniform number in ``[0, 1)`` that depends only on ``seed`` and ``index``."""
    z = (seed * _GOLDEN_64 + (index + 1) * 0xD1B54A32D192ED03) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def sample(
    logits: torch.Tensor,
    *,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs for a batch of rows.

    Args:
        logits: ``[batch, vocab]`` next-token logits.
        temperatures: ``[batch]``; a row with temperature 0 takes the argmax.
        top_ps: ``[batch]`` nucleus thresholds in ``(0, 1]``.
        uniforms: ``[batch]`` numbers in ``[0, 1)`` (see :func:`uniform`), one per row,
            turned into a token by inverse-CDF sampling over the probabilities sorted
            in descending order.

    Returns:
        ``(token_ids, logprobs)``, each ``[batch]``; log-probs are
        ``log_softmax(logits)`` at the chosen tokens.
    """
    logits = logits.float()
    temperatures, top_ps = temperatures.to(logits.device), top_ps.to(logits.device)
    uniforms = uniforms.to(logits.device)
    log_probs = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)
    greedy = temperatures == 0
    if not bool(greedy.all()):
        scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
        probs = torch.softmax(logits / scale.unsqueeze(-1).float(), dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Keep a token while the mass before it is under top_p: the most likely token
        # always stays, and the kept set is the smallest one reaching top_p.
        keep = (cumulative - sorted_probs) < top_ps.unsqueeze(-1)
        sorted_probs = sorted_probs * keep
        cumulative = sorted_probs.cumsum(dim=-1)
        threshold = uniforms.unsqueeze(-1).float() * cumulative[:, -1:]
        position = (cumulative <= threshold).sum(dim=-1, keepdim=True)
        position = position.clamp(max=logits.shape[-1] - 1)
        sampled = order.gather(-1, position).squeeze(-1)
        token_ids = torch.where(greedy, token_ids, sampled)
    return token_ids, log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
