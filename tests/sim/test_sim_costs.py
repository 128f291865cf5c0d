"""Compute-bound stage times and migration costs."""

import pytest

from dynarl.sim import (
    H100,
    ActorCost,
    DataParallelEfficiency,
    InferenceCost,
    MigrationCostModel,
    SimError,
    WeightSyncCost,
    model,
)
from dynarl.sim.costs import attended_context, expected_longest

SMALL, MEDIUM, LARGE = (model(f"R1-Distill-Qwen-{s}") for s in ("1.5B", "7B", "32B"))


def test_migration_defaults_reproduce_reference_measurements() -> None:
    costs = MigrationCostModel()
    # trainer reshard ≈0.5 s (1.5B) to ≈2.8 s (32B)
    assert costs.time_s("reshard", SMALL) == pytest.approx(0.5, abs=0.05)
    assert costs.time_s("reshard", LARGE) == pytest.approx(2.8, abs=0.1)
    # rollout (workload) migration: median 3.5–5 s
    for m in (SMALL, MEDIUM, LARGE):
        assert 3.4 <= costs.time_s("workload", m) <= 5.0
    # reboot is the slow fallback
    assert costs.time_s("reboot", MEDIUM) > 5 * costs.time_s("workload", MEDIUM)
    assert costs.bytes_moved("workload", MEDIUM) == MEDIUM.weight_bytes


def test_data_parallel_efficiency_falls_with_replicas() -> None:
    eff = DataParallelEfficiency(alpha=0.05)
    values = [eff(n) for n in (1, 2, 8, 64)]
    assert values[0] == 1.0
    assert values == sorted(values, reverse=True)
    assert values[-1] > 0.5
    with pytest.raises(SimError, match="at least one"):
        eff(0)


def test_actor_scales_with_devices_and_validates_sizes() -> None:
    actor = ActorCost(gpu=H100, model=MEDIUM, tp=4, mfu=0.35, n_minibatches=4)
    tokens = 8192 * 6000
    t16 = actor.iteration_time_s(tokens, 16)
    t32 = actor.iteration_time_s(tokens, 32)
    # doubling the devices nearly halves the time (data-parallel efficiency costs a bit)
    assert 0.5 < t32 / t16 < 0.56
    # compute bound: FLOPs / (devices x peak x MFU), within the efficiency and update
    ideal = tokens * MEDIUM.train_flops_per_token() / (16 * H100.bf16_flops_per_s * 0.35)
    assert ideal < t16 < 1.2 * ideal
    with pytest.raises(SimError, match="multiple of its instance size 4"):
        actor.step_time_s(1000, 6)


def test_inference_is_faster_than_training_on_same_devices() -> None:
    inference = InferenceCost(gpu=H100, model=SMALL, tp=2)
    actor = ActorCost(gpu=H100, model=SMALL, tp=2)
    tokens = 1e7
    assert inference.time_s(tokens, 8) < actor.step_time_s(tokens, 8) / 2
    assert inference.tokens_per_s(16) > 1.8 * inference.tokens_per_s(8)


def test_weight_sync_is_setup_plus_bytes_over_link() -> None:
    sync = WeightSyncCost(setup_s=0.5, bandwidth_bytes_per_s=50e9)
    assert sync.time_s(LARGE) == pytest.approx(0.5 + LARGE.weight_bytes / 50e9)
    assert sync.time_s(SMALL) < sync.time_s(MEDIUM) < sync.time_s(LARGE)


def test_attention_cost_follows_the_long_sequences_of_a_minibatch() -> None:
    """Causal attention grows with the square of a sequence's length: a minibatch with
    one 20K-token sequence among short ones costs more to train than the same tokens
    in equal sequences."""
    actor = ActorCost(gpu=H100, model=MEDIUM, tp=4)
    skewed = [20_000] + [500] * 40
    even = [sum(skewed) // len(skewed)] * len(skewed)
    assert attended_context(even) == pytest.approx(even[0] / 2)
    assert attended_context(skewed) > 5 * attended_context(even)
    tokens = sum(skewed)
    slow = actor.step_time_s(tokens, 8, attended_context(skewed))
    fast = actor.step_time_s(tokens, 8, attended_context(even))
    assert slow > 1.1 * fast


def test_the_expected_longest_of_a_draw_is_exact_on_small_cases() -> None:
    assert expected_longest([], 4) == 0.0
    assert expected_longest([5, 5, 5], 7) == pytest.approx(5.0)
    assert expected_longest([1, 3], 1) == pytest.approx(2.0)  # the mean
    # two draws from {1, 3}: the longest is 1 only if both are 1
    assert expected_longest([1, 3], 2) == pytest.approx(0.25 * 1 + 0.75 * 3)
    # it grows towards the longest with the draw's size
    tail = [10] * 99 + [1000]
    assert expected_longest(tail, 1) < expected_longest(tail, 64) < 1000
    assert expected_longest(tail, 64) == pytest.approx(10 + 990 * (1 - 0.99**64))
