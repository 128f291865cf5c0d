"""One finished sample as the pipeline driver keeps it: a single-turn response, or a
whole multi-turn episode with the mask of the tokens the policy sampled."""

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from dynarl.workers.rollout import Completion, FinishReason

EpisodeEnd = Literal["done", "truncated", "aborted"]
"""How an episode ended: its environment said done; a limit ended it (turns, tokens,
wall time); or the environment's infrastructure failed (not scored, not trained on)."""


class Episode(msgspec.Struct, frozen=True, kw_only=True):
    """A finished sample.

    Attributes:
        request_id: the sample's id.
        prompt_ids: the first prompt, as rendered.
        output_ids: everything after it: sampled turns and, between them, observations.
        output_logprobs: the engine's log-prob of each sampled token (0 on observations).
        output_mask: 1 on tokens the policy sampled, 0 on observations; ``None``: all 1
            (a single-turn response).
        weight_version: oldest weight version that sampled any of its tokens.
        reward: the environment's reward (the sum over its turns); ``None`` for a
            single-turn response, which the verifier scores.
        num_turns: assistant turns.
        finish_reason: how its last turn finished.
        end: how it ended.
        metrics: the environment's metrics, summed over the turns, and the episode's own
            (``turns``, ``env_s``).
        turn_tokens: (an episode) tokens each turn sampled.
        observation_tokens: (an episode) tokens each observation appended after its
            turn (one per turn that a next turn followed).
        step_latency_s: (an episode) seconds each of those environment steps took.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_mask: tuple[int, ...] | None = None
    weight_version: int = 0
    reward: float | None = None
    num_turns: int = 1
    finish_reason: FinishReason = "stop"
    end: EpisodeEnd = "done"
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    turn_tokens: tuple[int, ...] = ()
    observation_tokens: tuple[int, ...] = ()
    step_latency_s: tuple[float, ...] = ()

    @classmethod
    def of_completion(cls, completion: Completion) -> "Episode":
        """A single-turn response."""
        return cls(
            request_id=completion.request_id,
            prompt_ids=completion.prompt_ids,
            output_ids=completion.output_ids,
            output_logprobs=completion.output_logprobs,
            weight_version=completion.weight_version,
            finish_reason=completion.finish_reason,
        )

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled."""
        if self.output_mask is None:
            return len(self.output_ids)
        return sum(self.output_mask)


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """An iteration's episode metrics: per-episode means of each metric over the
    scored episodes, the tool-call rate, the prefix hit rate (the share of the turns'
    context tokens their engines found cached), and the truncated and aborted
    counts."""
    scored = [e for e in episodes if e.end != "aborted"]
    out: dict[str, float] = {
        "truncated": float(sum(e.end == "truncated" for e in episodes)),
        "aborted": float(len(episodes) - len(scored)),
    }
    if not scored:
        return out
    keys = sorted({k for e in scored for k in e.metrics})
    for key in keys:
        out[key] = float(np.mean([e.metrics.get(key, 0.0) for e in scored]))
    out["tool_call_rate"] = float(np.mean([e.metrics.get("tool_calls", 0.0) > 0 for e in scored]))
    context = sum(e.metrics.get("context_tokens", 0.0) for e in scored)
    if context > 0:
        cached = sum(e.metrics.get("cached_tokens", 0.0) for e in scored)
        out["prefix_hit_rate"] = cached / context
    return out
