"""What a simulated run measures: running counters of the world and per-iteration
records (throughput, busy device-seconds per component)."""

from collections.abc import Sequence

import msgspec

from dynarl.obs.trace_records import Request


class WorldTotals(msgspec.Struct, kw_only=True):
    """Counters since the world started: tokens generated (including those of aborted
    segments, so each token counts once), requests finished, tool calls, busy
    device-seconds of removed rollout engines and of optimizer steps, total migration
    time, and preemptions and tokens reported by removed engines."""

    generated_tokens: int = 0
    requests_done: int = 0
    tool_calls: int = 0
    rollout_device_s: float = 0.0
    actor_device_s: float = 0.0
    migration_s: float = 0.0
    preemptions: int = 0
    engine_tokens: int = 0

    def snapshot(self, *, busy_rollout: float, busy_inference: float) -> dict[str, float]:
        """The counters now, with busy device-seconds per component (the rollout's and
        inference's as their fleets count them now)."""
        return {
            "generated_tokens": float(self.generated_tokens),
            "requests_done": float(self.requests_done),
            "tool_calls": float(self.tool_calls),
            "busy_rollout": busy_rollout,
            "busy_inference": busy_inference,
            "busy_actor": self.actor_device_s,
        }


class IterationRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated iteration.

    ``busy_device_s`` is per component the device-seconds its workers did work (a
    rollout engine with any request running counts as busy, however small its batch).
    With partial rollouts (``algorithm.over_sample_prompts``), ``num_sequences`` is
    the samples it trained, ``carried_groups`` the groups it carried over to the next
    iteration, ``older_tokens`` the tokens of its trained responses that earlier
    iterations generated (older weights) out of ``trained_tokens``, and
    ``max_times_carried`` the most times one of its trained groups was carried.
    """

    iteration: int
    start_s: float
    end_s: float
    generated_tokens: int
    requests: int
    num_sequences: int
    tool_calls: int
    busy_device_s: dict[str, float]
    carried_groups: int = 0
    older_tokens: int = 0
    trained_tokens: int = 0
    max_times_carried: int = 0

    @property
    def duration_s(self) -> float:
        """Iteration time."""
        return self.end_s - self.start_s

    @property
    def older_token_fraction(self) -> float:
        """The share of its trained response tokens that older weights generated."""
        return self.older_tokens / self.trained_tokens if self.trained_tokens else 0.0

    @classmethod
    def between(
        cls,
        *,
        iteration: int,
        start_s: float,
        end_s: float,
        before: dict[str, float],
        after: dict[str, float],
        requests: Sequence[Request],
    ) -> "IterationRecord":
        """The record of the iteration between two :meth:`WorldTotals.snapshot`s."""

        def delta(key: str) -> float:
            return after[key] - before[key]

        return cls(
            iteration=iteration,
            start_s=start_s,
            end_s=end_s,
            generated_tokens=round(delta("generated_tokens")),
            requests=round(delta("requests_done")),
            num_sequences=len(requests),
            tool_calls=round(delta("tool_calls")),
            busy_device_s={c: delta(f"busy_{c}") for c in ("rollout", "inference", "actor")},
        )
