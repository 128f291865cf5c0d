"""The trainer's pluggable loss: a callable from logits and a micro-batch to an
unnormalised loss sum and its normaliser.

The trainer sums both over every micro-batch on every rank and divides the summed
gradient by the global normaliser, so the update does not depend on how the minibatch
is split over ranks and micro-batches. A loss therefore returns a *sum* (e.g. over
tokens) and the count it should be averaged by, never a local mean.
"""

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch


class LossOutput(NamedTuple):
    """What a loss returns for one micro-batch.

    Attributes:
        loss_sum: scalar tensor, summed (not averaged) over the micro-batch; gradients
            flow from it.
        normaliser: scalar tensor (or number) this micro-batch adds to the global count
            the summed loss is divided by.
    """

    loss_sum: torch.Tensor
    normaliser: torch.Tensor | float


class LossFn(Protocol):
    """A training loss; must be picklable (a module-level function or a struct-like
    object) because it is sent to the worker processes once at start."""

    def __call__(self, logits: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """Loss sum and normaliser of ``micro_batch`` given the model's ``logits``
        (``[batch, seq, vocab]``)."""
        ...


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
