"""What an iteration measured: its :class:`~dynarl.obs.metrics.IterationStats` (the
trained samples' rewards and lengths, the tokens it generated, its stages' seconds,
its episodes and, with partial rollouts, what it carried), and its trained samples as
trace lines."""

from dataclasses import dataclass

import numpy as np

from dynarl.obs.metrics import IterationStats
from dynarl.obs.trace_records import Request
from dynarl.rl.carry import CarryState, IterationGroups
from dynarl.rl.episode import Episode, episode_stats
from dynarl.rl.samples import Samples
from dynarl.rl.trace import episode_request


@dataclass(frozen=True)
class Measured:
    """An iteration's record, once its steps and its weight sync are over."""

    iteration: int
    """The iteration's 0-based index."""
    samples: Samples
    """Its samples (completions and rewards)."""
    groups: IterationGroups
    """Its groups (which it trained)."""
    losses: list[float]
    """Each optimizer step's loss."""
    norms: list[float]
    """Each optimizer step's gradient norm."""
    stage_s: dict[str, float]
    """Seconds each stage was busy."""
    elapsed_s: float
    """The iteration's wall time."""
    episodes: bool
    """Whether its samples are multi-turn episodes (their statistics are reported)."""
    partial: bool
    """Whether partial rollouts are on (what it carried is reported)."""


def iteration_stats(
    m: Measured,
    carried: CarryState,
    finished: dict[str, Episode],
    open_tokens: dict[str, int],
) -> IterationStats:
    """What the iteration measured; ``carried``: what it carries over, ``finished``:
    every sample that finished in it (those carried over included), ``open_tokens``:
    the tokens of the episodes it carries over still playing."""
    samples, trained = m.samples, m.groups.trained()
    kept = set(trained)
    completions = [c for rid, c in samples.completions.items() if rid in kept]
    scored = [rid for rid in trained if samples.completions[rid].end != "aborted"] or trained
    rewards = np.array([samples.rewards[rid] for rid in scored])
    gen_tokens = m.groups.generated_tokens(finished, open_tokens)
    return IterationStats(
        iteration=m.iteration,
        mean_reward=float(rewards.mean()),
        solved_fraction=float(np.mean(rewards >= 1.0)),
        num_samples=len(trained),
        gen_tokens=gen_tokens,
        mean_response_tokens=sum(c.num_sampled for c in completions) / len(trained),
        tokens_per_s=gen_tokens / m.elapsed_s,
        loss=float(np.mean(m.losses)),
        grad_norm=float(np.mean(m.norms)),
        weight_version=m.iteration + 1,
        stage_s=m.stage_s,
        elapsed_s=m.elapsed_s,
        episodes=episode_stats(completions) if m.episodes else {},
        partial_rollout=m.groups.stats(samples.completions, carried, weight_version=m.iteration)
        if m.partial
        else None,
    )


def trace_requests(iteration: int, samples: Samples, groups: IterationGroups) -> list[Request]:
    """The iteration's trained samples as trace lines, in request order."""
    group_of = groups.group_ids
    return [
        episode_request(
            samples.completions[rid], iteration=iteration, group=group_of[groups.group_of[rid]]
        )
        for rid in groups.trained()
    ]
