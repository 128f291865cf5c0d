"""One iteration's samples, as the pipeline driver learns about them: each response
(or multi-turn episode), its reward, its behaviour (and reference) log-probs, and which
groups are complete. Facts arrive from two stages (:class:`Rewarded` from the verifier
or the environment, :class:`Scored` from the inference instances); a sample is ready
once it has both (or, without an inference stage, once rewarded: the engine's own
log-probs are the behaviour policy's).

An episode whose environment's infrastructure failed (``end == "aborted"``) is not
scored: it keeps its row in the minibatch (so minibatches keep their shape) with no
token in the loss, and its group's advantages are computed without it.
"""

import time
from collections.abc import Sequence

import msgspec

from dynarl.core.ids import ItemId
from dynarl.rl.batch import Trajectory, with_advantages
from dynarl.rl.episode import Episode
from dynarl.workers.inference import LogprobResult


class Rewarded(msgspec.Struct, frozen=True):
    """Rewards of some responses (the reward stage's output)."""

    rewards: dict[str, float]


class Scored(msgspec.Struct, frozen=True):
    """Log-probs of some samples (the inference stage's output)."""

    results: tuple[LogprobResult, ...]


class Samples:
    """What the iteration knows of each sample, and which groups are complete.

    Args:
        request_ids: the iteration's samples, ``group_size`` per prompt in order.
        group_size: samples per group.
        needs_scores: log-probs come from inference (else from the engines).
    """

    def __init__(self, request_ids: Sequence[str], group_size: int, needs_scores: bool) -> None:
        self.ids = list(request_ids)
        self.group_of = {rid: i // group_size for i, rid in enumerate(self.ids)}
        self.completions: dict[str, Episode] = {}
        self.rewards: dict[str, float] = {}
        self.logprobs: dict[str, tuple[float, ...]] = {}
        self.ref_logprobs: dict[str, tuple[float, ...] | None] = {}
        self._needs_scores = needs_scores
        self._missing = dict.fromkeys(range(len(self.ids) // group_size), group_size)
        self._ready: set[str] = set()
        self.in_flight = 0  # samples between their response and their readiness
        self.busy_s = 0.0  # wall time with some sample in flight
        self._since = 0.0

    def completed(self, completion: Episode) -> None:
        """A response (or episode) arrived from rollout; an aborted episode is ready
        at once (nothing to score)."""
        self.completions[completion.request_id] = completion
        if not self._needs_scores or completion.end == "aborted":
            self.logprobs[completion.request_id] = completion.output_logprobs
            self.ref_logprobs[completion.request_id] = None
        if not self.in_flight:
            self._since = time.perf_counter()
        self.in_flight += 1

    def add(self, fact: Rewarded | Scored) -> list[int]:
        """Record ``fact``; returns the groups it completed."""
        if isinstance(fact, Rewarded):
            self.rewards.update(fact.rewards)
            return self._ready_groups(list(fact.rewards))
        for result in fact.results:
            self.logprobs[result.item_id] = tuple(result.logprobs)
            refs = result.ref_logprobs
            self.ref_logprobs[result.item_id] = None if refs is None else tuple(refs)
        return self._ready_groups([r.item_id for r in fact.results])

    def _ready_groups(self, ids: Sequence[str]) -> list[int]:
        out = []
        for rid in ids:
            if rid in self._ready or rid not in self.rewards or rid not in self.logprobs:
                continue
            self._ready.add(rid)
            self.in_flight -= 1
            if not self.in_flight:
                self.busy_s += time.perf_counter() - self._since
            group = self.group_of[rid]
            self._missing[group] -= 1
            if not self._missing[group]:
                out.append(group)
        return out

    def trajectories(self, groups: Sequence[int]) -> tuple[list[Trajectory], list[ItemId]]:
        """The trajectories of ``groups`` (in request order), with advantages."""
        chosen = set(groups)
        ids = [rid for rid in self.ids if self.group_of[rid] in chosen]
        rows = {rid: self._trajectory(rid) for rid in ids}
        scored = [rid for rid in ids if self.completions[rid].end != "aborted"]
        advantaged = with_advantages([rows[rid] for rid in scored])
        rows.update(zip(scored, advantaged, strict=True))
        return [rows[rid] for rid in ids], [ItemId(rid) for rid in ids]

    def _trajectory(self, rid: str) -> Trajectory:
        c = self.completions[rid]
        mask = c.output_mask
        if c.end == "aborted":
            mask = (0,) * len(c.output_ids)  # kept for the minibatch's shape, not trained
        refs = self.ref_logprobs[rid]
        return Trajectory(
            group_id=self.group_of[rid],
            prompt_ids=c.prompt_ids,
            output_ids=c.output_ids,
            old_logprobs=self.logprobs[rid],
            reward=self.rewards[rid],
            ref_logprobs=None if refs is None else tuple(refs),
            weight_version=c.weight_version,
            output_mask=mask,
        )
