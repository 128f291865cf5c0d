"""The GRPO loss against hand-computed gradients, and its limiting cases."""

import pickle

import pytest
import torch

from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.grpo import GrpoLoss, LossInputError

VOCAB = 5


def _batch(seed: int = 0, *, batch: int = 3, seq: int = 6) -> dict[str, torch.Tensor]:
    """Sequences with prompts of different lengths, response masks and padding."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq)
    loss_mask[0, 2:6] = 1  # prompt of 2, response of 4
    loss_mask[1, 3:5] = 1  # prompt of 3, response of 2, one padding position
    if batch > 2:
        loss_mask[2, 1:4] = 1
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "old_logprobs": -torch.rand(batch, seq, generator=g) - 1.0,
        "advantages": torch.randn(batch, generator=g),
        "ref_logprobs": -torch.rand(batch, seq, generator=g) - 1.0,
    }


def _logits(seed: int = 1, *, batch: int = 3, seq: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, VOCAB, generator=g, dtype=torch.float32).requires_grad_()


def _grad(loss: GrpoLoss, logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    loss_sum, normaliser = loss(logits, mb)
    (loss_sum / normaliser).backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    grad = logits.grad.clone()
    logits.grad = None
    return grad


def _reference_grad(
    logits: torch.Tensor, mb: dict[str, torch.Tensor], *, eps: float, kl_coef: float
) -> torch.Tensor:
    """The token-mean gradient written out by hand, token by token, in float64:
    d/dz of -min(r A, clip(r) A) is -A r (onehot - softmax) when unclipped and 0 when
    clipped; d/dz of k3 = exp(ref - logp) - (ref - logp) - 1 is (1 - exp(ref - logp))
    (onehot - softmax)."""
    z = logits.detach().double()
    grad = torch.zeros_like(z)
    num_tokens = float(mb["loss_mask"].sum())
    batch, seq = mb["input_ids"].shape
    for b in range(batch):
        adv = float(mb["advantages"][b])
        for t in range(1, seq):
            if mb["loss_mask"][b, t] == 0:
                continue
            token = int(mb["input_ids"][b, t])
            probs = torch.softmax(z[b, t - 1], dim=-1)
            onehot = torch.zeros(VOCAB, dtype=torch.float64)
            onehot[token] = 1.0
            dlogp = onehot - probs
            logp = float(torch.log(probs[token]))
            ratio = torch.exp(torch.tensor(logp - float(mb["old_logprobs"][b, t]))).item()
            clipped = (adv > 0 and ratio > 1 + eps) or (adv < 0 and ratio < 1 - eps)
            g = torch.zeros(VOCAB, dtype=torch.float64) if clipped else -adv * ratio * dlogp
            if kl_coef:
                diff = float(mb["ref_logprobs"][b, t]) - logp
                g = g + kl_coef * (1.0 - torch.exp(torch.tensor(diff)).item()) * dlogp
            grad[b, t - 1] += g / num_tokens
    return grad


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_gradient_matches_hand_computed_reference(kl_coef: float) -> None:
    mb = _batch()
    mb["advantages"] = torch.tensor([0.8, -1.3, 0.5])
    logits = _logits()
    # Put one token's ratio far outside the clip range each way (with the advantage's
    # sign, so both are clipped), the rest near 1: both branches run.
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, mb["input_ids"][:, 1:, None])
        mb["old_logprobs"][0, 3] = logp[0, 2, 0] - 1.0  # ratio e
        mb["old_logprobs"][1, 4] = logp[1, 3, 0] + 1.0  # ratio 1/e
    loss = GrpoLoss(clip_eps=0.2, kl_coef=kl_coef)
    got = _grad(loss, logits, mb)
    expected = _reference_grad(logits, mb, eps=0.2, kl_coef=kl_coef)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)


def test_ratio_one_reduces_to_the_policy_gradient() -> None:
    mb = _batch()
    logits = _logits()
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
    mb["old_logprobs"][:, 1:] = logp.detach()
    got = _grad(GrpoLoss(clip_eps=0.2), logits, mb)
    mask = mb["loss_mask"][:, 1:]
    reinforce = -(mb["advantages"][:, None] * logp * mask).sum() / mask.sum()
    reinforce.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    torch.testing.assert_close(got, logits.grad)


def test_clipping_kicks_in_only_past_the_clip_range_in_the_advantage_direction() -> None:
    mb = _batch()
    logits = _logits()
    loss = GrpoLoss(clip_eps=0.2)
    logp = loss.terms(logits, mb).logprobs.detach()
    mb["advantages"] = torch.tensor([1.0, -1.0, 1.0])
    shift = torch.zeros_like(logp)
    shift[0] = 0.5  # ratio e^0.5 ~ 1.65 with A > 0: clipped, no gradient
    shift[1] = 0.5  # the same ratio with A < 0: not clipped (the pessimistic branch)
    shift[2] = 0.1  # ratio ~ 1.105, inside the range: not clipped
    mb["old_logprobs"][:, 1:] = logp - shift
    terms = loss.terms(logits, mb)
    mask = terms.mask
    assert torch.all(terms.clipped[0][mask[0] > 0] == 1)
    assert torch.all(terms.clipped[1:][mask[1:] > 0] == 0)
    grad = _grad(loss, logits, mb)
    assert torch.count_nonzero(grad[0]) == 0
    assert torch.count_nonzero(grad[1]) > 0 and torch.count_nonzero(grad[2]) > 0


def test_kl_term_vanishes_when_policy_equals_reference() -> None:
    mb = _batch()
    logits = _logits()
    loss = GrpoLoss(kl_coef=1.0)
    logp = loss.terms(logits, mb).logprobs.detach()
    mb["ref_logprobs"][:, 1:] = logp
    terms = loss.terms(logits, mb)
    assert torch.count_nonzero(terms.kl * terms.mask) == 0
    # The KL term adds no gradient either: the result equals the loss without it.
    torch.testing.assert_close(_grad(loss, logits, mb), _grad(GrpoLoss(), logits, mb))
    # ... and is positive once the policy moves away from the reference.
    mb["ref_logprobs"][:, 1:] = logp - 0.3
    assert float((loss.terms(logits, mb).kl * terms.mask).sum().detach()) > 0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_micro_batch_split_does_not_change_the_loss(loss_agg: str) -> None:
    """The trainer sums loss sums and normalisers over micro-batches and ranks; the
    result must equal the whole minibatch's (so resizing data parallelism is exact)."""
    mb = _batch(seed=3, batch=3)
    logits = _logits(seed=4, batch=3)
    loss = GrpoLoss(kl_coef=0.1, loss_agg=loss_agg)  # type: ignore[arg-type]
    whole_sum, whole_norm = loss(logits, mb)
    parts = [loss(logits[i : i + 1], {k: v[i : i + 1] for k, v in mb.items()}) for i in range(3)]
    split = sum(p.loss_sum for p in parts) / sum(float(p.normaliser) for p in parts)
    torch.testing.assert_close(whole_sum / whole_norm, split)


def test_seq_mean_weighs_sequences_equally() -> None:
    mb = _batch()
    logits = _logits()
    mb["old_logprobs"][:, 1:] = GrpoLoss().terms(logits, mb).logprobs.detach()
    loss_sum, normaliser = GrpoLoss(loss_agg="seq-mean")(logits, mb)
    # At ratio 1 each sequence's mean token loss is -A, so the mean over sequences is
    # -mean(A) whatever the response lengths (4, 2 and 3 tokens here).
    assert float(normaliser) == 3.0
    assert float((loss_sum / normaliser).detach()) == pytest.approx(
        -float(mb["advantages"].mean()), abs=1e-6
    )


def test_from_config_and_missing_fields() -> None:
    loss = GrpoLoss.from_config(AlgorithmConfig(clip_eps=0.3, kl_coef=0.05, loss_agg="seq-mean"))
    assert (loss.clip_eps, loss.kl_coef, loss.loss_agg) == (0.3, 0.05, "seq-mean")
    assert pickle.loads(pickle.dumps(loss)) == loss  # sent to trainer processes
    mb = _batch()
    del mb["ref_logprobs"]
    with pytest.raises(LossInputError, match="ref_logprobs"):
        loss(_logits(), mb)
    mb = _batch()
    mb["old_logprobs"] = mb["old_logprobs"][:, :-1]
    with pytest.raises(LossInputError, match="old_logprobs"):
        GrpoLoss()(_logits(), mb)
