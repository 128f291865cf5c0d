"""Sampling tokens from logits: greedy, temperature, top-p, counter-based randomness."""

import torch

from dynarl.workers.torch.sampler import sample, uniform


def _sample(logits: torch.Tensor, temperature: float, top_p: float, u: list[float]) -> list[int]:
    n = len(u)
    tokens, _ = sample(
        logits.expand(n, -1),
        temperatures=torch.full((n,), temperature),
        top_ps=torch.full((n,), top_p),
        uniforms=torch.tensor(u, dtype=torch.float64),
    )
    return tokens.tolist()


def test_uniform_depends_only_on_seed_and_index() -> None:
    draws = [uniform(7, i) for i in range(2000)]
    assert draws == [uniform(7, i) for i in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert uniform(8, 0) != uniform(7, 0)


def test_greedy_takes_the_argmax_and_reports_raw_log_softmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample(
        logits,
        temperatures=torch.zeros(2),
        top_ps=torch.ones(2),
        uniforms=torch.tensor([0.99, 0.5], dtype=torch.float64),
    )
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, expected)


def test_sampling_follows_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    tokens = _sample(logits, 0.5, 1.0, [uniform(1, i) for i in range(n)])
    expected = torch.softmax(logits[0] / 0.5, -1)
    observed = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(observed, expected, atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    draws = [uniform(2, i) for i in range(500)]
    assert set(_sample(probs.log(), 1.0, 0.75, draws)) == {0, 1}
    assert set(_sample(probs.log(), 1.0, 0.1, draws)) == {0}
    assert set(_sample(probs.log(), 1.0, 1.0, draws)) == {0, 1, 2, 3}


def test_reported_log_prob_ignores_temperature_and_top_p() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    tokens, logprobs = sample(
        logits,
        temperatures=torch.tensor([0.3]),
        top_ps=torch.tensor([0.5]),
        uniforms=torch.tensor([0.2], dtype=torch.float64),
    )
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[0, tokens])
