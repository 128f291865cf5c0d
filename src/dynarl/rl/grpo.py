"""The GRPO policy loss: a clipped importance-weighted policy gradient on response
tokens, with an optional KL penalty to a reference policy.

It implements the trainer's :class:`~dynarl.workers.trainer.LossFn`: it returns a
loss *sum* and the count to divide it by, and the trainer divides the sum over every
micro-batch and rank by the *global* count. Both aggregations therefore mean the same
thing whatever the data-parallel size and micro-batch split:

- ``token-mean``: every response token of the minibatch weighs the same (the
  normaliser is the number of response tokens);
- ``seq-mean``: each sequence's tokens are averaged first, then sequences weigh the
  same (the normaliser is the number of sequences with a response token).

The minibatch fields it reads (laid out by :mod:`dynarl.rl.batch`), all ``[batch, seq]``
and aligned with ``input_ids`` (the value at position ``t`` is about token ``t``):
``loss_mask`` (1 on response tokens), ``old_logprobs`` (the behaviour policy's log-prob
of each token), ``advantages`` (``[batch]``, one per sequence, or ``[batch, seq]``) and,
when ``kl_coef > 0``, ``ref_logprobs``.
"""

from collections.abc import Mapping
from typing import Annotated, Literal, NamedTuple

import msgspec
import torch

from dynarl.core.errors import DynaRLError
from dynarl.rl.config import AlgorithmConfig
from dynarl.workers.trainer import LossOutput

LossAgg = Literal["token-mean", "seq-mean"]
"""How token losses are aggregated; see the module docstring."""

REQUIRED_FIELDS = ("input_ids", "loss_mask", "old_logprobs", "advantages")
"""Minibatch fields every GRPO step needs."""


class LossInputError(DynaRLError):
    """A micro-batch lacks a field the loss needs or has one of the wrong shape; build
    minibatches with :func:`dynarl.rl.batch.to_arrays`."""


class GrpoTerms(NamedTuple):
    """Per-token pieces of the loss, ``[batch, seq - 1]``, for position ``t + 1``.

    Attributes:
        logprobs: the current policy's log-prob of each target token.
        ratio: importance ratio ``exp(logprobs - old_logprobs)``.
        policy_loss: the clipped surrogate, negated (what is minimised).
        kl: k3 estimate of KL(current || reference), or zeros without a reference.
        clipped: 1 where the clipped branch was taken (its gradient is zero).
        mask: 1 on response tokens.
    """

    logprobs: torch.Tensor
    ratio: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor
    mask: torch.Tensor


class GrpoLoss(msgspec.Struct, frozen=True, kw_only=True):
    """The GRPO loss (picklable, so it can be sent to trainer processes).

    Attributes:
        clip_eps: the importance ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``.
        clip_eps_high: upper clip range (DAPO's "clip-higher"); ``None`` uses ``clip_eps``.
        kl_coef: weight of the k3 KL estimator to ``ref_logprobs``; 0 disables it (and
            the field is not needed).
        loss_agg: ``token-mean`` or ``seq-mean``.
    """

    clip_eps: Annotated[float, msgspec.Meta(gt=0.0)] = 0.2
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    loss_agg: LossAgg = "token-mean"

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> "GrpoLoss":
        """The loss of the ``algorithm`` section."""
        return cls(clip_eps=config.clip_eps, kl_coef=config.kl_coef, loss_agg=config.loss_agg)

    def terms(self, logits: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> GrpoTerms:
        """The per-token terms of the loss (see :class:`GrpoTerms`)."""
        _check_fields(micro_batch, needs_ref=self.kl_coef > 0)
        targets = micro_batch["input_ids"][:, 1:]
        mask = micro_batch["loss_mask"][:, 1:].to(torch.float32)
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        old = micro_batch["old_logprobs"][:, 1:].to(torch.float32)
        advantages = micro_batch["advantages"].to(torch.float32)
        advantages = advantages[:, 1:] if advantages.ndim == 2 else advantages.unsqueeze(-1)
        # Outside the mask the difference is arbitrary (padding); zero it so exp() stays
        # finite and nothing there can produce NaN gradients.
        log_ratio = torch.where(mask > 0, logprobs - old, torch.zeros_like(logprobs))
        ratio = torch.exp(log_ratio)
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps, 1.0 + high)
        unclipped_obj = ratio * advantages
        clipped_obj = clipped_ratio * advantages
        policy_loss = -torch.minimum(unclipped_obj, clipped_obj)
        clipped = (clipped_obj < unclipped_obj).to(torch.float32)
        if self.kl_coef > 0:
            ref = micro_batch["ref_logprobs"][:, 1:].to(torch.float32)
            log_ref_ratio = torch.where(mask > 0, ref - logprobs, torch.zeros_like(logprobs))
            # k3 (Schulman): unbiased for KL(pi || ref) under samples from pi, and >= 0.
            kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        else:
            kl = torch.zeros_like(logprobs)
        return GrpoTerms(logprobs, ratio, policy_loss, kl, clipped, mask)

    def __call__(self, logits: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """Loss sum and normaliser of ``micro_batch`` (see the module docstring)."""
        t = self.terms(logits, micro_batch)
        token_loss = (t.policy_loss + self.kl_coef * t.kl) * t.mask
        if self.loss_agg == "token-mean":
            return LossOutput(loss_sum=token_loss.sum(), normaliser=t.mask.sum())
        tokens = t.mask.sum(dim=1)
        per_sequence = token_loss.sum(dim=1) / tokens.clamp(min=1.0)
        return LossOutput(loss_sum=per_sequence.sum(), normaliser=(tokens > 0).sum().float())


def _check_fields(micro_batch: Mapping[str, torch.Tensor], *, needs_ref: bool) -> None:
    required = REQUIRED_FIELDS + (("ref_logprobs",) if needs_ref else ())
    missing = [name for name in required if name not in micro_batch]
    if missing:
        hint = " (kl_coef > 0 needs reference log-probs)" if "ref_logprobs" in missing else ""
        raise LossInputError(f"the micro-batch lacks {missing}{hint}; it has {sorted(micro_batch)}")
    shape = micro_batch["input_ids"].shape
    for name in required[1:]:
        got = micro_batch[name].shape
        if name == "advantages" and tuple(got) in ((shape[0],), tuple(shape)):
            continue
        if name != "advantages" and got == shape:
            continue
        raise LossInputError(
            f"micro-batch field {name!r} has shape {list(got)} but input_ids has {list(shape)}"
        )
