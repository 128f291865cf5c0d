"""Partial rollouts in the simulated world: which groups an iteration trains, and which
carry over to the next one.

With ``algorithm.over_sample_prompts`` (``O``) an iteration's rollout runs
``num_prompts`` (``K``) + ``O`` groups: the groups carried over from the last iteration
(their unfinished requests resume with every token they generated, their finished
samples wait) and fresh ones. A group whose every sample has finished is **admitted**
to training: always if it was carried ``max_staleness`` times (it is *due*), otherwise
while fewer than ``K`` minus the due groups are admitted; a group whole beyond that
quota waits, whole, for the next iteration. Admission is final, so a trainer that
takes minibatches of whole groups as they complete never trains a group the
iteration does not keep. The rollout is over once ``K`` groups are admitted; the world
then withdraws every request still pending, and the groups not admitted carry over
(one more time carried each). A finished sample goes downstream (to inference, or the
trainer) only once its group is admitted, so no sample is scored by weights that will
not train it.
"""

from collections.abc import Iterable, Sequence

from dynarl.core.ids import GroupId
from dynarl.obs.trace_records import Request
from dynarl.rl.config import AlgorithmConfig
from dynarl.sim.progress import SeqProgress


class _Group:
    __slots__ = ("finished", "members", "times_carried", "tokens_before")

    def __init__(self, members: list[SeqProgress]) -> None:
        self.members = members
        self.finished: list[SeqProgress] = []
        self.times_carried = 0
        self.tokens_before = 0  # tokens its samples had generated when this iteration began


class PartialRollouts:
    """The groups in flight across iterations, and the admission rule above.

    Args:
        algorithm: the batch shape, ``over_sample_prompts`` and ``max_staleness``.
    """

    def __init__(self, algorithm: AlgorithmConfig) -> None:
        self.num_prompts = algorithm.num_prompts
        self.group_size = algorithm.group_size
        self.in_flight_groups = algorithm.num_prompts + algorithm.over_sample_prompts
        self.staleness_bound = algorithm.staleness_bound
        self._groups: dict[GroupId, _Group] = {}
        self._admitted: list[GroupId] = []
        self._quota = 0
        self._others_admitted = 0
        self._due: set[GroupId] = set()

    def fresh_groups_needed(self) -> int:
        """How many fresh groups the next iteration starts."""
        return self.in_flight_groups - len(self._groups)

    def begin(self, fresh: Sequence[Request]) -> tuple[list[SeqProgress], list[SeqProgress]]:
        """Start an iteration with the carried groups and ``fresh`` requests (whole
        groups, :meth:`fresh_groups_needed` of them). Returns the requests to roll out
        (the carried ones first, each with its progress) and the samples to send
        downstream at once (those of carried groups that are whole and admitted now)."""
        self._admitted = []
        self._others_admitted = 0
        carried = list(self._groups.values())
        for seqs in _by_group(fresh):
            self._groups[seqs[0].request.group] = _Group(seqs)
        for g in self._groups.values():
            g.tokens_before = sum(s.generated() for s in g.members)
        self._due = {
            gid for gid, g in self._groups.items() if g.times_carried >= self.staleness_bound > 0
        }
        self._quota = self.num_prompts - len(self._due)
        assert self._quota >= 0, "over_sample_prompts <= num_prompts bounds the due groups"
        ready: list[SeqProgress] = []
        # Whole groups carried over are admitted first, the oldest first.
        for g in sorted(carried, key=lambda g: -g.times_carried):
            if len(g.finished) == self.group_size:
                ready.extend(self._admit(g))
        finished = {id(s) for g in carried for s in g.finished}
        rollout = [s for g in carried for s in g.members if id(s) not in finished]
        rollout += [s for g in self._groups.values() if g.times_carried == 0 for s in g.members]
        return rollout, ready

    def finished(self, seqs: Iterable[SeqProgress]) -> list[SeqProgress]:
        """Samples that finished their rollout; returns those to send downstream now
        (every sample of each group this admits, in group order)."""
        out: list[SeqProgress] = []
        for s in seqs:
            g = self._groups[s.request.group]
            g.finished.append(s)
            if len(g.finished) == self.group_size:
                out.extend(self._admit(g))
        return out

    @property
    def groups_to_complete(self) -> int:
        """Groups not due the rollout must still complete before it is over."""
        return max(self._quota - self._others_admitted, 0)

    @property
    def groups_due(self) -> tuple[GroupId, ...]:
        """The due groups not yet admitted: the rollout completes each of them."""
        admitted = set(self._admitted)
        return tuple(sorted(g for g in self._due if g not in admitted))

    @property
    def rollout_over(self) -> bool:
        """Whether the iteration has admitted every group it trains."""
        return len(self._admitted) >= self.num_prompts

    def end(self) -> tuple[list[Request], int, int]:
        """End the iteration: forget the groups it trained, carry the others over.
        Returns the trained requests (in admission order), the tokens of their
        responses generated in earlier iterations, and the most times one of their
        groups was carried."""
        trained: list[Request] = []
        older_tokens = most_carried = 0
        for gid in self._admitted:
            g = self._groups.pop(gid)
            trained.extend(s.request for s in g.members)
            older_tokens += g.tokens_before
            most_carried = max(most_carried, g.times_carried)
        for g in self._groups.values():
            g.times_carried += 1
        self._admitted = []
        return trained, older_tokens, most_carried

    @property
    def num_carried_groups(self) -> int:
        """Groups in flight that the current iteration has not admitted."""
        return len(self._groups) - len(self._admitted)

    def _admit(self, g: _Group) -> list[SeqProgress]:
        gid = g.members[0].request.group
        if gid not in self._due:
            if self._others_admitted >= self._quota:
                return []  # whole beyond the quota: trained next iteration
            self._others_admitted += 1
        self._admitted.append(gid)
        return sorted(g.finished, key=lambda s: s.request.id)


def _by_group(requests: Sequence[Request]) -> list[list[SeqProgress]]:
    groups: dict[GroupId, list[SeqProgress]] = {}
    for r in requests:
        groups.setdefault(r.group, []).append(SeqProgress(r))
    return list(groups.values())
