"""Admission: which of an iteration's groups it trains.

An iteration rolls out ``num_prompts`` (``N``) groups, or, with partial rollouts
(``algorithm.over_sample_prompts``), more. A group is **admitted** to training once
every sample of it has finished: always if it is *due* (carried over
``max_staleness`` times: admitted from the start, and the rollout does not end
without it), otherwise while fewer than ``N`` minus the due groups are admitted, in the
order groups become whole. Admission is final, so the actor, which takes minibatches
of whole groups as they complete, never trains a group the iteration does not keep,
and the rollout is over once the ``N`` admitted groups are whole. Without partial
rollouts every group is due, and the rollout is over when all are whole.

Pure bookkeeping: no awaits, no clock; :mod:`dynarl.rl.carry` feeds it.
"""

from collections.abc import Collection


class Admission:
    """Which of an iteration's groups it trains (the rule in the module docstring),
    told of every sample that finishes, in order.

    Args:
        num_groups: the iteration's groups, numbered from 0.
        group_size: samples per group.
        num_trained: groups the iteration trains.
        due: groups it must train, admitted from the start (at most ``num_trained``).
    """

    def __init__(
        self, *, num_groups: int, group_size: int, num_trained: int, due: Collection[int]
    ) -> None:
        assert len(due) <= num_trained <= num_groups, "over_sample_prompts <= num_prompts"
        self._group_size = group_size
        self._num_trained = num_trained
        self._quota = num_trained - len(due)  # admissions left for groups not due
        self._finished = [0] * num_groups
        self._num_whole = 0  # admitted groups that are whole
        self.due = frozenset(due)
        """The groups it must train."""
        self.admitted: list[int] = sorted(due)
        """The groups admitted, in admission order (the due ones first)."""
        self._admitted = set(self.admitted)

    def finished(self, group: int) -> bool:
        """A sample of ``group`` finished; whether this admitted the group (it is whole
        now and within the quota; a due group was admitted before)."""
        self._finished[group] += 1
        if self._finished[group] < self._group_size:
            return False
        assert self._finished[group] == self._group_size, f"group {group} finished twice"
        if group in self._admitted:
            self._num_whole += 1
            return False
        if not self._quota:
            return False  # whole beyond the quota: it waits, whole, for the next iteration
        self._quota -= 1
        self._num_whole += 1
        self.admitted.append(group)
        self._admitted.add(group)
        return True

    @property
    def quota_left(self) -> int:
        """How many more groups not due it admits."""
        return self._quota

    def is_admitted(self, group: int) -> bool:
        """Whether the iteration trains ``group``."""
        return group in self._admitted

    @property
    def over(self) -> bool:
        """Whether every group the iteration trains is admitted and whole: the rollout
        may end."""
        return self._num_whole == self._num_trained
