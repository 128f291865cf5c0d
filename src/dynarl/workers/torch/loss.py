"""The trainer's pluggable loss: a callable from logits and a micro-batch to an
unnormalised loss sum and its normaliser.

The trainer sums both over every micro-batch on every rank and divides the summed
gradient by the global normaliser, so the update does not depend on how the minibatch
is split over ranks and micro-batches. A loss therefore returns a *sum* (e.g. over
tokens) and the count it should be averaged by, never a local mean.
"""

from collections.abc import Mapping

import torch

from dynarl.workers.trainer import LossOutput


def weighted_nll(logits: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> LossOutput:
    """Token-weighted negative log-likelihood of ``input_ids`` under the model.

    ``micro_batch["loss_weights"]`` (``[batch, seq]``) weighs the prediction of each
    token from its prefix (position 0 is never predicted); the normaliser is the sum of
    the weights, so the global loss is the weighted mean NLL over the whole minibatch.
    """
    targets = micro_batch["input_ids"][:, 1:]
    weights = micro_batch["loss_weights"][:, 1:].to(torch.float32)
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return LossOutput(loss_sum=(nll * weights).sum(), normaliser=weights.sum())
