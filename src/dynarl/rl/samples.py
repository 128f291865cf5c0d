"""One iteration's samples, as the pipeline driver learns about them: each response
(or multi-turn episode), its reward, its behaviour (and reference) log-probs, and which
groups are complete. Facts arrive from two stages (:class:`Rewarded` from the verifier
or the environment, :class:`Scored` from the inference instances); a sample is ready
once it has both (or, without an inference stage, once rewarded: the engine's own
log-probs are the behaviour policy's).

An episode whose environment's infrastructure failed (``end == "aborted"``) is not
scored: it keeps its row in the minibatch (so minibatches keep their shape) with no
token in the loss, and its group's advantages are computed without it.

With partial rollouts (:mod:`dynarl.rl.carry`) the groups an iteration does not train
are set aside once its rollout is over: their samples are rewarded (the reward carries
over with them) but no longer waited for.
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
        self._group_size = group_size
        self._missing = dict.fromkeys(range(len(self.ids) // group_size), group_size)
        self._ready: set[str] = set()
        self._waiting: set[str] = set()  # samples between their response and readiness
        self._aside: set[int] = set()  # groups carried over: their samples not waited for
        self.busy_s = 0.0  # wall time with some sample in flight
        self._since = 0.0

    @property
    def in_flight(self) -> int:
        """Samples between their response and their readiness."""
        return len(self._waiting)

    def completed(self, completion: Episode) -> None:
        """A response (or episode) arrived from rollout; an aborted episode is ready
        at once (nothing to score)."""
        rid = completion.request_id
        self.completions[rid] = completion
        if not self._needs_scores or completion.end == "aborted":
            self.logprobs[rid] = completion.output_logprobs
            self.ref_logprobs[rid] = None
        if self.group_of[rid] not in self._aside:
            if not self._waiting:
                self._since = time.perf_counter()
            self._waiting.add(rid)

    def set_aside(self, groups: Sequence[int]) -> None:
        """These groups are not trained in this iteration (they carry over): their
        samples are no longer waited for."""
        self._aside.update(groups)
        for group in groups:
            for rid in self.ids_of(group):
                self._stop_waiting(rid)

    def ids_of(self, group: int) -> list[str]:
        """The samples of ``group``, in request order."""
        size = self._group_size
        return self.ids[group * size : (group + 1) * size]

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
            self._stop_waiting(rid)
            group = self.group_of[rid]
            self._missing[group] -= 1
            if not self._missing[group]:
                out.append(group)
        return out

    def _stop_waiting(self, rid: str) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            if not self._waiting:
                self.busy_s += time.perf_counter() - self._since

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
