"""The reference loop learns the embedded task from a random init, on CPU."""

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from dynarl.api.config import ActorConfig, AlgorithmConfig, DynaRLConfig, RolloutConfig, RunConfig
from dynarl.workers.torch.reference_loop import IterationMetrics, run_inprocess

pytestmark = pytest.mark.slow

NUM_ITERATIONS = 40

CONFIG = DynaRLConfig(
    algorithm=AlgorithmConfig(num_prompts=16, group_size=4, n_minibatches=2),
    rollout=RolloutConfig(max_new_tokens=128),
    actor=ActorConfig(lr=3e-3, micro_batch_size=32),
    run=RunConfig(seed=0),
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny kernels run fastest on one thread (and like a CPU device slot)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_short_run_improves_reward(record_property: Callable[[str, object], None]) -> None:
    """Seed 0 measured: first-5 mean reward ~0.16, last-5 (iterations 35-39) ~0.5, and
    another seed ~0.2 -> ~0.8; a random policy's iterations vary by a few hundredths."""
    history: list[IterationMetrics] = run_inprocess(CONFIG, num_iterations=NUM_ITERATIONS)
    rewards = np.array([m.mean_reward for m in history])
    first, last = float(rewards[:5].mean()), float(rewards[-5:].mean())
    record_property("first5_mean_reward", first)
    record_property("last5_mean_reward", last)
    record_property("wall_s", sum(m.elapsed_s for m in history))
    assert last > first + 0.2, rewards.round(3).tolist()
    # The policy learned to stop: at the start many responses ran to max_new_tokens.
    assert np.mean([m.mean_response_tokens for m in history[-5:]]) < 0.5 * np.mean(
        [m.mean_response_tokens for m in history[:2]]
    )
    assert [m.iteration for m in history] == list(range(NUM_ITERATIONS))
