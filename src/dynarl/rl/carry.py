"""Partial rollouts' carried state: what an iteration carries over to the next, and
one iteration's groups as it rolls them out.

With ``algorithm.over_sample_prompts`` (``O``) an iteration rolls out ``num_prompts``
(``N``) + ``O`` groups: first the groups carried over from the last iteration (their
unfinished requests resume from their partial output; their finished samples wait,
with their reward, for the rest of their group), then fresh ones. Which groups it
trains is its :class:`~dynarl.rl.admission.Admission`'s to say: the groups carried
``max_staleness`` times are due, the others are admitted as they become whole (whole
carried groups first, the most often carried first), ``N`` in all. Once those are
whole the requests still out are withdrawn, keeping their tokens, and the groups not
admitted carry over, one more time carried each: a finished sample as its response and
its reward (which does not depend on the policy), an unfinished one as its request
holding every token it generated, an unfinished multi-turn episode as an
:class:`OpenEpisode`: the episode runner keeps playing it (its environment alive, its
transcript kept) in the next iteration, and a resumed run, whose runner never played
it, restarts it from its first turn (a live environment cannot be saved in a
checkpoint). A sample is scored (its old log-probs, by the
inference stage) only once its group is admitted, so every score comes from the
weights of the iteration that trains it.

Without partial rollouts the same rules hold trivially: nothing is carried, every group
is due (``staleness_bound`` is 0) and the rollout ends when all are whole.
"""

from collections.abc import Container, Mapping, Sequence

import msgspec

from dynarl.core.ids import GroupId
from dynarl.envs.prompts import Prompt
from dynarl.obs.metrics import PartialRolloutStats
from dynarl.rl.admission import Admission
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode
from dynarl.workers.rollout import GenerateRequest


class PartialSample(msgspec.Struct, frozen=True, kw_only=True, tag="partial"):
    """A carried sample that had not finished: its request, holding every token it
    generated so far (and their log-probs), resumes in the next iteration."""

    request: GenerateRequest

    @property
    def request_id(self) -> str:
        """The sample's id."""
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.request.output_ids)


class FinishedSample(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """A carried sample that had finished, waiting for the rest of its group: its
    response and its reward."""

    response: Episode
    reward: float

    @property
    def request_id(self) -> str:
        """The sample's id."""
        return self.response.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens its policy sampled."""
        return self.response.num_sampled


class OpenEpisode(msgspec.Struct, frozen=True, kw_only=True, tag="open"):
    """A carried multi-turn episode still playing: the episode runner holds it (its
    environment, its transcript, the request of its next turn).

    Attributes:
        request: the episode's request as it started (its id, seed and sampling): a
            resumed run restarts the episode from it.
        num_tokens: tokens its policy sampled so far.
    """

    request: GenerateRequest
    num_tokens: int

    @property
    def request_id(self) -> str:
        """The sample's id."""
        return self.request.request_id


CarriedSample = PartialSample | FinishedSample | OpenEpisode
"""One sample of a carried group."""


class CarriedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A group carried over to the next iteration.

    Attributes:
        group: its router group id (kept across iterations, as are its samples' ids).
        prompt: the prompt its samples answer (what the verifier checks against).
        times_carried: iterations it has been carried out of.
        samples: its ``group_size`` samples, in request order.
    """

    group: GroupId
    prompt: Prompt
    times_carried: int
    samples: tuple[CarriedSample, ...]


class CarryState(msgspec.Struct, frozen=True, kw_only=True):
    """What a partial rollout carries from one iteration to the next (saved with a
    checkpoint, so a resumed run resumes it too)."""

    groups: tuple[CarriedGroup, ...] = ()

    @property
    def num_samples(self) -> int:
        """Samples carried."""
        return sum(len(g.samples) for g in self.groups)

    def ended(self, episodes: Mapping[str, Episode]) -> "CarryState":
        """This state with the open episodes among ``episodes`` finished, each as its
        response and its reward (an environment step still running when they were
        carried over ended them)."""
        if not episodes:
            return self

        def sample(s: CarriedSample) -> CarriedSample:
            episode = episodes.get(s.request_id) if isinstance(s, OpenEpisode) else None
            if episode is None:
                return s
            return FinishedSample(response=episode, reward=episode.reward or 0.0)

        return CarryState(
            groups=tuple(
                msgspec.structs.replace(g, samples=tuple(sample(s) for s in g.samples))
                for g in self.groups
            )
        )


def fresh_groups(algorithm: AlgorithmConfig, carried: CarryState) -> int:
    """How many fresh groups (prompts) the next iteration starts: ``num_prompts`` +
    ``over_sample_prompts`` in flight, the carried ones included."""
    return max(0, algorithm.num_prompts + algorithm.over_sample_prompts - len(carried.groups))


class IterationGroups:
    """One iteration's groups: those carried in, then fresh ones; which it trains (its
    :class:`~dynarl.rl.admission.Admission`); where its rollout requests are; and what
    it carries out.

    Args:
        algorithm: the batch shape, ``over_sample_prompts`` and ``max_staleness``.
        carried: what the last iteration carried over.
        fresh: the fresh groups (:func:`fresh_groups` of them): each one's router group
            id, prompt and ``group_size`` requests.
        playing: the carried open episodes the episode runner still plays (the others,
            a resumed run's, restart from their first turn).
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        carried: CarryState,
        fresh: Sequence[tuple[GroupId, Prompt, Sequence[GenerateRequest]]],
        playing: Container[str] = frozenset(),
    ) -> None:
        size = self.group_size = algorithm.group_size
        self.group_ids: list[GroupId] = [g.group for g in carried.groups]
        """Each group's router group id, by group index."""
        self.prompts: list[Prompt] = [g.prompt for g in carried.groups]
        """Each group's prompt, by group index."""
        self.times_carried = [g.times_carried for g in carried.groups]
        self.request_ids: list[str] = []
        """Every sample's id, ``group_size`` per group in group order."""
        self.rollout: list[GenerateRequest] = []
        """The requests to roll out: the carried unfinished ones (resuming from their
        partial output; an open episode's as it started) first, then the fresh ones."""
        self.waiting: list[tuple[Episode, float]] = []
        """The carried finished samples with their rewards."""
        self.tokens_before: dict[str, int] = {}
        """Tokens each carried sample had when the iteration began: older weights
        generated them."""
        self.restarted: list[str] = []
        """The carried open episodes that restart from their first turn."""
        for g in carried.groups:
            for s in g.samples:
                self.request_ids.append(s.request_id)
                self.tokens_before[s.request_id] = s.num_tokens
                if isinstance(s, FinishedSample):
                    self.waiting.append((s.response, s.reward))
                    continue
                self.rollout.append(s.request)
                if isinstance(s, OpenEpisode) and s.request_id not in playing:
                    self.restarted.append(s.request_id)
                    self.tokens_before[s.request_id] = 0
        self.num_resumed = len(self.rollout) - len(self.restarted)
        for group, prompt, requests in fresh:
            assert len(requests) == size, "a fresh group has group_size requests"
            self.group_ids.append(group)
            self.prompts.append(prompt)
            self.times_carried.append(0)
            self.request_ids.extend(r.request_id for r in requests)
            self.rollout.extend(requests)
        self.group_of = {rid: k // size for k, rid in enumerate(self.request_ids)}
        """Each sample's group index."""
        self.outstanding = {r.request_id for r in self.rollout}
        """Rollout requests that have not come back."""
        self.unfinished: dict[str, GenerateRequest] = {}
        """Requests that came back unfinished (withdrawn), holding their output."""
        self.open: set[str] = set()
        """Episodes withdrawn unfinished, which the episode runner keeps playing."""
        self._started = {r.request_id: r for r in self.rollout}
        self.withdrawn = False
        bound = algorithm.staleness_bound
        self.admission = Admission(
            num_groups=len(self.group_ids),
            group_size=size,
            num_trained=algorithm.num_prompts,
            due=[k for k, times in enumerate(self.times_carried) if times >= bound],
        )
        self._finished: list[list[str]] = [[] for _ in self.group_ids]
        self.score_first: list[str] = []
        """The carried finished samples to score at once: those of due groups, then
        those of the whole carried groups admitted now, the most often carried first."""
        by_age = sorted(
            self.waiting, key=lambda w: -self.times_carried[self.group_of[w[0].request_id]]
        )
        for episode, _ in by_age:
            self.score_first += self.finished([episode.request_id])

    def finished(self, request_ids: Sequence[str]) -> list[str]:
        """These samples finished their rollout: returns the finished samples to score
        now, each once (a sample of an admitted group at once; when its group is
        admitted, all of the group's)."""
        out: list[str] = []
        for rid in request_ids:
            self.outstanding.discard(rid)
            group = self.group_of[rid]
            self._finished[group].append(rid)
            if self.admission.finished(group):
                out.extend(self._finished[group])
            elif self.admission.is_admitted(group):
                out.append(rid)
        return out

    def came_back(self, request: GenerateRequest) -> None:
        """A withdrawn request came back unfinished, holding the tokens it generated."""
        self.outstanding.discard(request.request_id)
        self.unfinished[request.request_id] = request

    def came_back_open(self, request_id: str) -> None:
        """A withdrawn episode is settled with the episode runner, which keeps it."""
        self.outstanding.discard(request_id)
        self.open.add(request_id)

    def to_withdraw(self) -> list[str] | None:
        """The requests still out, to withdraw, the first time it is asked once every
        group the iteration trains is whole (the groups not trained are set aside
        then); ``None`` before, and after."""
        if self.withdrawn or not self.admission.over:
            return None
        self.withdrawn = True
        return sorted(self.outstanding)

    @property
    def rollout_over(self) -> bool:
        """Every group the iteration trains is whole and every request is back."""
        return self.admission.over and not self.outstanding

    def trained(self) -> list[str]:
        """The samples of the groups the iteration trains, in request order."""
        return [rid for rid in self.request_ids if self.admission.is_admitted(self.group_of[rid])]

    def set_aside(self) -> list[int]:
        """The groups the iteration does not train (once its rollout is over)."""
        return [k for k in range(len(self.group_ids)) if not self.admission.is_admitted(k)]

    def carry_out(
        self,
        completions: Mapping[str, Episode],
        rewards: Mapping[str, float],
        open_tokens: Mapping[str, int] | None = None,
    ) -> CarryState:
        """What carries over once the iteration is over: every group it did not train,
        once more carried, each sample finished (its response and reward) or not (its
        request as it came back, with its partial output; an open episode with the
        tokens ``open_tokens`` says it sampled)."""
        assert not self.outstanding, "every rollout request came back"
        size = self.group_size
        groups = []
        for k in self.set_aside():
            samples: list[CarriedSample] = []
            for rid in self.request_ids[k * size : (k + 1) * size]:
                if rid in completions:
                    samples.append(FinishedSample(response=completions[rid], reward=rewards[rid]))
                elif rid in self.open:
                    assert open_tokens is not None, "an open episode's tokens are known"
                    samples.append(
                        OpenEpisode(request=self._started[rid], num_tokens=open_tokens[rid])
                    )
                else:
                    samples.append(PartialSample(request=self.unfinished[rid]))
            groups.append(
                CarriedGroup(
                    group=self.group_ids[k],
                    prompt=self.prompts[k],
                    times_carried=self.times_carried[k] + 1,
                    samples=tuple(samples),
                )
            )
        return CarryState(groups=tuple(groups))

    def generated_tokens(
        self, completions: Mapping[str, Episode], open_tokens: Mapping[str, int] | None = None
    ) -> int:
        """Tokens the iteration's engines generated: those of its finished and its
        unfinished samples (open episodes: ``open_tokens``), less those they had when
        it began."""
        before = self.tokens_before
        done = sum(c.num_sampled - before.get(rid, 0) for rid, c in completions.items())
        out = self.unfinished.items()
        done += sum(len(r.output_ids) - before.get(rid, 0) for rid, r in out)
        opened = (open_tokens or {}).items()
        return done + sum(n - before.get(rid, 0) for rid, n in opened)

    def stats(
        self, completions: Mapping[str, Episode], carried_out: CarryState, *, weight_version: int
    ) -> PartialRolloutStats:
        """What the iteration's partial rollout carried, and how stale what it trained
        was; ``weight_version``: the weights its engines held."""
        trained = [completions[rid] for rid in self.trained()]
        tokens = sum(e.num_sampled for e in trained)
        stale = sum(self.tokens_before.get(e.request_id, 0) for e in trained)
        return PartialRolloutStats(
            num_carried_in=len(self.tokens_before),
            num_resumed=self.num_resumed,
            num_carried_out=carried_out.num_samples,
            max_times_carried=max(
                (self.times_carried[k] for k in self.admission.admitted), default=0
            ),
            max_weight_lag=max(
                (weight_version - e.weight_version for e in trained if e.num_sampled), default=0
            ),
            stale_token_fraction=stale / tokens if tokens else 0.0,
        )
