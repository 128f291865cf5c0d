"""Teacher-forced per-token log-probs of given sequences: the number the trainer, the
inference worker and the rollout engine must agree on."""

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from dynarl.workers.torch.errors import EngineError


@torch.inference_mode()
def sequence_logprobs(
    model: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    *,
    starts: Sequence[int],
    pad_token_id: int = 0,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Log-prob of every token of ``sequences[i][starts[i]:]`` given the tokens before it.

    One forward pass over the batch, right-padded (the padding is masked out and comes
    after every real token, so it changes nothing). ``temperature`` divides the logits
    first; 1 gives the model's own distribution, which is what the rollout engine
    reports.

    Returns:
        One float32 tensor per sequence, of length ``len(sequences[i]) - starts[i]``, on
        the CPU.
    """
    if len(starts) != len(sequences):
        raise EngineError(f"got {len(sequences)} sequences but {len(starts)} starts")
    for i, (tokens, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 1 <= start <= len(tokens):
            raise EngineError(
                f"sequence {i} has {len(tokens)} tokens and start {start}; the start must be "
                "between 1 (score all but the first token) and the sequence length"
            )
    if not sequences:
        return []
    width = max(len(tokens) for tokens in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
    positions = torch.arange(width).expand(len(sequences), width)
    device = model.device
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        use_cache=False,
    ).logits
    results = []
    for row, (tokens, start) in enumerate(zip(sequences, starts, strict=True)):
        scores = logits[row, start - 1 : len(tokens) - 1].float() / temperature
        targets = input_ids[row, start : len(tokens)].to(device)
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, targets.unsqueeze(-1))
        results.append(log_probs.squeeze(-1).cpu())
    return results
