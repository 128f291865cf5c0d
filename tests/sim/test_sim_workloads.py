"""Workload generators: calibration to the published shapes, determinism."""

import numpy as np
import pytest

from dynarl.core.ids import GroupId, ItemId
from dynarl.sim import AgenticWorkload, MathWorkload, Request, SimError, ToolLatency, TraceError


def _lengths(requests: tuple[Request, ...]) -> np.ndarray:
    return np.array([r.output_tokens[0] for r in requests])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_math_lengths_are_heavy_tailed_and_capped(seed: int) -> None:
    workload = MathWorkload()
    requests = workload.generate(np.random.default_rng(seed))
    lengths = _lengths(requests)
    assert len(requests) == 8192
    assert 10 <= np.percentile(lengths, 99) / np.median(lengths) <= 30
    assert 0.05 <= np.mean(lengths >= workload.max_output_tokens) <= 0.15
    assert lengths.max() == 28672
    prompts = np.array([r.prompt_tokens for r in requests])
    assert prompts.min() >= 16
    assert prompts.max() <= 1024


def test_math_lengths_correlate_within_groups() -> None:
    requests = MathWorkload().generate(np.random.default_rng(0))
    logs = np.log(_lengths(requests)).reshape(512, 16)
    # share of the variance explained by the prompt (intra-class correlation)
    between = logs.mean(axis=1).var()
    within = logs.var(axis=1).mean()
    assert between / (between + within) > 0.6
    assert [r.group for r in requests[:16]] == [GroupId("it0-p0")] * 16
    assert requests[17].id == ItemId("it0-p1-s1")


def test_generators_are_deterministic() -> None:
    for workload in (MathWorkload(num_prompts=32), AgenticWorkload(num_prompts=32)):
        first = workload.generate(np.random.default_rng(5), iteration=3)
        assert first == workload.generate(np.random.default_rng(5), iteration=3)
        assert first != workload.generate(np.random.default_rng(6), iteration=3)
        assert first[0].id.startswith("it3-")


def test_agentic_turns_shorten_and_tools_follow_their_latency_model() -> None:
    workload = AgenticWorkload()
    requests = workload.generate(np.random.default_rng(0))
    calls = np.array([r.num_tool_calls for r in requests])
    # only a first turn that runs into the length cap ends without a tool call
    truncated = [r for r in requests if r.num_tool_calls == 0]
    assert all(r.total_output_tokens == workload.max_output_tokens for r in truncated)
    assert len(truncated) < 0.05 * len(requests)
    assert calls.max() >= 10
    assert 2.3 <= calls.mean() <= 3.2
    turn_means = [
        np.mean([r.output_tokens[k] for r in requests if r.num_tool_calls >= k]) for k in range(4)
    ]
    assert turn_means == sorted(turn_means, reverse=True)
    assert all(r.total_output_tokens <= workload.max_output_tokens for r in requests)
    latency = np.array([x for r in requests for x in r.tool_latency_s])
    ok = np.array([x for r in requests for x in r.tool_ok], dtype=bool)
    assert latency.mean() == pytest.approx(0.3, rel=0.1)
    assert latency.max() <= 4.0
    assert np.all((latency == 4.0) == ~ok)  # a failed call is one that hit the timeout
    assert 0 < np.sum(~ok) < 0.01 * len(ok)
    assert all(
        r.total_tokens > r.prompt_tokens + r.total_output_tokens
        for r in requests
        if r.num_tool_calls
    )


def test_tool_latency_is_lognormal_with_the_given_mean() -> None:
    latency, ok = ToolLatency(mean_s=0.05, sigma=0.5, timeout_s=4.0).sample(
        np.random.default_rng(0), 20_000
    )
    assert latency.mean() == pytest.approx(0.05, rel=0.05)
    assert ok.all()


def test_request_checks_its_turn_structure() -> None:
    with pytest.raises(TraceError, match="2 turns need 1 tool calls"):
        Request(id=ItemId("r"), group=GroupId("g"), prompt_tokens=10, output_tokens=(5, 5))
    with pytest.raises(SimError, match="at least one call"):
        AgenticWorkload(mean_tool_calls=0.5).generate(np.random.default_rng(0))
