"""Partial rollouts in the simulated world: which groups an iteration trains, and which
carry over to the next one.

With ``algorithm.over_sample_prompts`` (``O``) an iteration's rollout runs
``num_prompts`` (``K``) + ``O`` groups: the groups carried over from the last iteration
(their unfinished requests resume with every token they generated, their finished
samples wait) and fresh ones. Which of them it trains is the real pipeline's rule,
:class:`~dynarl.rl.admission.Admission`: a group carried ``max_staleness`` times is
*due* (trained whatever else finishes), the others are admitted as they become whole
while fewer than ``K`` minus the due groups are; a group whole beyond that quota waits,
whole, for the next iteration. The rollout is over once the ``K`` groups it trains are
whole; the world then withdraws every request still pending, and the groups not
admitted carry over (one more time carried each). A finished sample goes downstream
(to inference, or the trainer) once its group is whole and admitted, so no sample is
scored by weights that will not train it (the real pipeline scores a due group's
samples as they finish; here they wait for the group, as every other group's do).
"""

from collections.abc import Iterable, Sequence

from dynarl.core.ids import GroupId
from dynarl.obs.trace_records import Request
from dynarl.rl.admission import Admission
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
    """The groups in flight across iterations; which of them an iteration trains is
    its :class:`~dynarl.rl.admission.Admission`'s to say (the real pipeline's rule).

    Args:
        algorithm: the batch shape, ``over_sample_prompts`` and ``max_staleness``.
    """

    def __init__(self, algorithm: AlgorithmConfig) -> None:
        self.num_prompts = algorithm.num_prompts
        self.group_size = algorithm.group_size
        self.in_flight_groups = algorithm.num_prompts + algorithm.over_sample_prompts
        self.staleness_bound = algorithm.staleness_bound
        self._groups: dict[GroupId, _Group] = {}
        self._ids: list[GroupId] = []  # this iteration's groups, by admission index
        self._index: dict[GroupId, int] = {}
        self._admission = Admission(num_groups=0, group_size=1, num_trained=0, due=())
        self._whole: list[GroupId] = []  # admitted groups, in the order they became whole

    def fresh_groups_needed(self) -> int:
        """How many fresh groups the next iteration starts."""
        return self.in_flight_groups - len(self._groups)

    def begin(self, fresh: Sequence[Request]) -> tuple[list[SeqProgress], list[SeqProgress]]:
        """Start an iteration with the carried groups and ``fresh`` requests (whole
        groups, :meth:`fresh_groups_needed` of them). Returns the requests to roll out
        (the carried ones first, each with its progress) and the samples to send
        downstream at once (those of carried groups that are whole and admitted now)."""
        carried = list(self._groups.values())
        for seqs in _by_group(fresh):
            self._groups[seqs[0].request.group] = _Group(seqs)
        self._ids = list(self._groups)
        self._index = {gid: k for k, gid in enumerate(self._ids)}
        for g in self._groups.values():
            g.tokens_before = sum(s.generated() for s in g.members)
        bound = self.staleness_bound
        self._admission = Admission(
            num_groups=len(self._ids),
            group_size=self.group_size,
            num_trained=self.num_prompts,
            due=[k for k, g in enumerate(self._groups.values()) if g.times_carried >= bound],
        )
        self._whole = []
        ready: list[SeqProgress] = []
        # The samples carried over finished count first, the oldest groups' first: a
        # whole carried group is admitted before any other.
        for g in sorted(carried, key=lambda g: -g.times_carried):
            k = self._index[g.members[0].request.group]
            for _ in g.finished:
                self._admission.finished(k)
            ready.extend(self._if_whole(g))
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
            self._admission.finished(self._index[s.request.group])
            out.extend(self._if_whole(g))
        return out

    @property
    def groups_to_complete(self) -> int:
        """Groups not due the rollout must still complete before it is over."""
        return self._admission.quota_left

    @property
    def groups_due(self) -> tuple[GroupId, ...]:
        """The due groups not yet whole: the rollout completes each of them."""
        due = (self._ids[k] for k in self._admission.due)
        return tuple(sorted(g for g in due if len(self._groups[g].finished) < self.group_size))

    @property
    def rollout_over(self) -> bool:
        """Whether every group the iteration trains is admitted and whole."""
        return self._admission.over

    def end(self) -> tuple[list[Request], int, int]:
        """End the iteration: forget the groups it trained, carry the others over.
        Returns the trained requests (in the order their groups became whole), the
        tokens of their responses generated in earlier iterations, and the most times
        one of their groups was carried."""
        trained: list[Request] = []
        older_tokens = most_carried = 0
        for gid in self._whole:
            g = self._groups.pop(gid)
            trained.extend(s.request for s in g.members)
            older_tokens += g.tokens_before
            most_carried = max(most_carried, g.times_carried)
        for g in self._groups.values():
            g.times_carried += 1
        self._whole = []
        return trained, older_tokens, most_carried

    @property
    def num_carried_groups(self) -> int:
        """Groups in flight that the current iteration has not admitted."""
        return len(self._groups) - len(self._whole)

    def _if_whole(self, g: _Group) -> list[SeqProgress]:
        """``g``'s samples, if it is whole now and the iteration trains it."""
        gid = g.members[0].request.group
        if len(g.finished) < self.group_size or not self._admission.is_admitted(self._index[gid]):
            return []  # not whole, or whole beyond the quota: trained next iteration
        self._whole.append(gid)
        return sorted(g.finished, key=lambda s: s.request.id)


def _by_group(requests: Sequence[Request]) -> list[list[SeqProgress]]:
    groups: dict[GroupId, list[SeqProgress]] = {}
    for r in requests:
        groups.setdefault(r.group, []).append(SeqProgress(r))
    return list(groups.values())
