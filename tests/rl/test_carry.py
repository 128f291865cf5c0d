"""Partial rollouts' rules, without processes: which groups an iteration trains (the
due ones whatever finishes first, then in the order they become whole), what carries
over (finished samples with their reward, unfinished ones with every token), and over
many iterations: exactly ``num_prompts`` groups trained each time, none staler than
``max_staleness``, no sample lost, trained twice, or missing a token."""

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.core.ids import GroupId
from dynarl.envs.prompts import Prompt
from dynarl.rl.carry import (
    CarriedGroup,
    CarryState,
    FinishedSample,
    IterationGroups,
    OpenEpisode,
    PartialSample,
    fresh_groups,
)
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode
from dynarl.rl.samples import Rewarded, Samples
from dynarl.workers.rollout import GenerateRequest

G = 2


def algo(num_prompts: int, over: int, staleness: int | None = None) -> AlgorithmConfig:
    return AlgorithmConfig(
        num_prompts=num_prompts,
        group_size=G,
        n_minibatches=1,
        over_sample_prompts=over,
        max_staleness=staleness,
    )


def fresh(iteration: int, num_groups: int) -> list[tuple[GroupId, Prompt, list[GenerateRequest]]]:
    return [
        (
            GroupId(f"{iteration}/{p}"),
            Prompt(prompt_id=str(p), text=f"prompt {p}"),
            [
                GenerateRequest(request_id=f"{iteration}-{p}-{g}", prompt_ids=(1, 2))
                for g in range(G)
            ],
        )
        for p in range(num_groups)
    ]


def response(rid: str, num_tokens: int, version: int = 0) -> Episode:
    return Episode(
        request_id=rid,
        prompt_ids=(1, 2),
        output_ids=tuple(range(num_tokens)),
        output_logprobs=(-1.0,) * num_tokens,
        weight_version=version,
    )


def partial(rid: str, num_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_ids=(1, 2),
        output_ids=tuple(range(num_tokens)),
        output_logprobs=(-1.0,) * num_tokens,
        weight_version=0,
    )


def test_without_partial_rollouts_every_group_is_trained_and_scored_as_it_finishes() -> None:
    groups = IterationGroups(algorithm=algo(2, 0), carried=CarryState(), fresh=fresh(0, 2))
    assert groups.admission.admitted == [0, 1]  # every group is due
    ids = groups.request_ids
    assert [groups.finished([rid]) for rid in ids[:3]] == [[rid] for rid in ids[:3]]
    assert not groups.admission.over and groups.to_withdraw() is None
    groups.finished([ids[3]])
    assert groups.rollout_over and groups.to_withdraw() == []
    assert groups.trained() == ids
    completions = {rid: response(rid, 3) for rid in ids}
    assert groups.carry_out(completions, dict.fromkeys(ids, 1.0)) == CarryState()


def test_groups_are_trained_as_they_become_whole_and_the_rest_carry_their_tokens() -> None:
    groups = IterationGroups(algorithm=algo(2, 2), carried=CarryState(), fresh=fresh(0, 4))
    assert groups.admission.admitted == []
    # group 2 becomes whole first, then group 3; group 0 has one sample done
    assert groups.finished(["0-2-0"]) == []  # held back until its group is admitted
    assert groups.finished(["0-0-0"]) == []
    assert groups.finished(["0-2-1"]) == ["0-2-0", "0-2-1"]
    assert groups.finished(["0-3-1", "0-3-0"]) == ["0-3-1", "0-3-0"]
    assert groups.admission.admitted == [2, 3] and groups.admission.over
    assert not groups.rollout_over
    assert groups.to_withdraw() == ["0-0-1", "0-1-0", "0-1-1"]
    assert groups.to_withdraw() is None  # once
    # group 1 finishes before its abort lands: whole, but beyond the quota
    assert groups.finished(["0-1-0", "0-1-1"]) == []
    groups.came_back(partial("0-0-1", 5))
    assert groups.rollout_over and groups.set_aside() == [0, 1]
    done = ["0-2-0", "0-2-1", "0-3-1", "0-3-0", "0-0-0", "0-1-0", "0-1-1"]
    completions = {rid: response(rid, 4) for rid in done}
    rewards = {rid: float(k) for k, rid in enumerate(done)}
    carried = groups.carry_out(completions, rewards)
    assert carried == CarryState(
        groups=(
            CarriedGroup(
                group=GroupId("0/0"),
                prompt=groups.prompts[0],
                times_carried=1,
                samples=(
                    FinishedSample(response=completions["0-0-0"], reward=4.0),
                    PartialSample(request=partial("0-0-1", 5)),
                ),
            ),
            CarriedGroup(
                group=GroupId("0/1"),
                prompt=groups.prompts[1],
                times_carried=1,
                samples=(
                    FinishedSample(response=completions["0-1-0"], reward=5.0),
                    FinishedSample(response=completions["0-1-1"], reward=6.0),
                ),
            ),
        )
    )
    assert groups.trained() == ["0-2-0", "0-2-1", "0-3-0", "0-3-1"]
    # a checkpoint keeps it whole
    assert msgspec.json.decode(msgspec.json.encode(carried), type=CarryState) == carried


def test_carried_groups_resume_first_and_a_due_one_is_trained_whatever_finishes_first() -> None:
    carried = CarryState(
        groups=(
            CarriedGroup(
                group=GroupId("0/0"),
                prompt=Prompt(prompt_id="a", text="a"),
                times_carried=1,
                samples=(
                    FinishedSample(response=response("0-0-0", 4), reward=1.0),
                    PartialSample(request=partial("0-0-1", 7)),
                ),
            ),
        )
    )
    algorithm = algo(1, 1)  # max_staleness 1: a group carried once is due
    assert fresh_groups(algorithm, carried) == 1
    groups = IterationGroups(algorithm=algorithm, carried=carried, fresh=fresh(1, 1))
    assert groups.rollout[0] == partial("0-0-1", 7)  # resumed first, from its output
    assert groups.request_ids == ["0-0-0", "0-0-1", "1-0-0", "1-0-1"]
    assert groups.admission.admitted == [0]
    assert groups.score_first == ["0-0-0"]  # scored by this iteration's weights
    assert groups.finished(["1-0-0", "1-0-1"]) == []  # whole first, but not due
    assert not groups.admission.over
    assert groups.finished(["0-0-1"]) == ["0-0-1"]
    assert groups.to_withdraw() == []
    completions = {
        "0-0-0": response("0-0-0", 4, version=0),
        "0-0-1": response("0-0-1", 10, version=0),
        "1-0-0": response("1-0-0", 6, version=1),
        "1-0-1": response("1-0-1", 2, version=1),
    }
    out = groups.carry_out(completions, dict.fromkeys(completions, 0.0))
    assert [(g.group, g.times_carried) for g in out.groups] == [("1/0", 1)]
    stats = groups.stats(completions, out, weight_version=1)
    assert (stats.num_carried_in, stats.num_resumed, stats.num_carried_out) == (2, 1, 2)
    assert (stats.max_times_carried, stats.max_weight_lag) == (1, 1)
    assert stats.stale_token_fraction == (4 + 7) / (4 + 10)
    # 3 tokens this iteration for 0-0-1, 8 for the fresh group
    assert groups.generated_tokens(completions) == 3 + 8


def test_whole_carried_groups_go_first_the_most_often_carried_first() -> None:
    def whole(name: str, times: int) -> CarriedGroup:
        samples = tuple(
            FinishedSample(response=response(f"{name}-{g}", 3), reward=1.0) for g in range(G)
        )
        return CarriedGroup(
            group=GroupId(name),
            prompt=Prompt(prompt_id=name, text=name),
            times_carried=times,
            samples=samples,
        )

    carried = CarryState(groups=(whole("y", 1), whole("x", 2)))
    algorithm = AlgorithmConfig(
        num_prompts=1, group_size=G, n_minibatches=1, over_sample_prompts=1, max_staleness=3
    )
    assert fresh_groups(algorithm, carried) == 0
    groups = IterationGroups(algorithm=algorithm, carried=carried, fresh=[])
    assert groups.admission.admitted == [1] and groups.score_first == ["x-0", "x-1"]
    assert groups.rollout_over and groups.to_withdraw() == []  # nothing to roll out
    completions = {
        s.request_id: s.response
        for g in carried.groups
        for s in g.samples
        if isinstance(s, FinishedSample)
    }
    out = groups.carry_out(completions, dict.fromkeys(completions, 1.0))
    assert [(g.group, g.times_carried) for g in out.groups] == [("y", 2)]


def test_samples_of_groups_set_aside_are_no_longer_waited_for() -> None:
    samples = Samples(["a", "b", "c", "d"], G, needs_scores=True)
    for rid in "abc":
        samples.completed(response(rid, 2))
    samples.add(Rewarded(dict.fromkeys("abc", 1.0)))
    assert samples.in_flight == 3  # waiting for their scores
    samples.set_aside([1])
    assert samples.in_flight == 2
    samples.completed(response("d", 2))  # finished after the rollout ended: not waited for
    assert samples.in_flight == 2


@settings(max_examples=60, deadline=None)
@given(
    num_prompts=st.integers(1, 4),
    over=st.integers(0, 4),
    staleness=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_over_many_iterations_every_sample_is_trained_once_whole_and_never_too_stale(
    num_prompts: int, over: int, staleness: int, seed: int
) -> None:
    """Requests decode in lockstep, each to a length drawn for it; an iteration's
    rollout ends once its admitted groups are whole, and the requests still out carry
    the tokens they generated so far."""
    over = min(over, num_prompts)
    algorithm = algo(num_prompts, over, staleness if over else None)
    rng = np.random.default_rng(seed)
    target: dict[str, int] = {}

    def tokens(rid: str, n: int) -> tuple[int, ...]:  # each request's own token stream
        return tuple(hash((rid, k)) % 1000 for k in range(n))

    carried, drawn, trained = CarryState(), set[str](), set[str]()
    for it in range(6):
        new = fresh(it, fresh_groups(algorithm, carried))
        for _, _, requests in new:
            for r in requests:
                target[r.request_id] = int(rng.integers(1, 30))
                drawn.add(r.request_id)
        groups = IterationGroups(algorithm=algorithm, carried=carried, fresh=new)
        completions = {e.request_id: e for e, _ in groups.waiting}
        rewards = {e.request_id: r for e, r in groups.waiting}
        left = {r.request_id: target[r.request_id] - len(r.output_ids) for r in groups.rollout}
        assert min(left.values(), default=0) >= 0
        elapsed = 0
        for rid in sorted(left, key=lambda r: (left[r], r)):
            if groups.admission.over:
                break
            elapsed = left[rid]
            completions[rid] = Episode(
                request_id=rid,
                prompt_ids=(1, 2),
                output_ids=tokens(rid, target[rid]),
                output_logprobs=(0.0,) * target[rid],
            )
            rewards[rid] = 1.0
            groups.finished([rid])
        rest = groups.to_withdraw()
        assert rest is not None
        for rid in rest:  # each generated as many tokens as the rollout lasted
            before = next(r for r in groups.rollout if r.request_id == rid).output_ids
            assert before == tokens(rid, len(before))  # carried with every token
            n = len(before) + min(elapsed, left[rid])
            groups.came_back(
                GenerateRequest(
                    request_id=rid,
                    prompt_ids=(1, 2),
                    output_ids=tokens(rid, n),
                    output_logprobs=(0.0,) * n,
                )
            )
        assert groups.rollout_over
        admitted = groups.admission.admitted
        assert len(admitted) == num_prompts  # exactly num_prompts groups trained
        assert all(groups.times_carried[k] <= algorithm.staleness_bound for k in admitted)
        now = groups.trained()
        assert not trained & set(now)  # each once
        for rid in now:
            assert completions[rid].output_ids == tokens(rid, target[rid])  # whole
        trained |= set(now)
        carried = groups.carry_out(completions, rewards)
        assert len(carried.groups) <= over
        assert all(g.times_carried <= algorithm.staleness_bound for g in carried.groups)
        still = {s.request_id for g in carried.groups for s in g.samples}
        assert trained | still == drawn and not trained & still  # none lost


def test_an_open_episode_carries_over_and_restarts_only_where_no_runner_plays_it() -> None:
    """A multi-turn episode withdrawn mid-session carries over as an open episode
    with the tokens its policy sampled; the next iteration resumes it where the runner
    still plays it (its tokens older), and restarts it from its first turn where none
    does (a resumed run: its tokens not counted as carried)."""
    groups = IterationGroups(algorithm=algo(1, 1), carried=CarryState(), fresh=fresh(0, 2))
    assert groups.finished(["0-1-0", "0-1-1"]) == ["0-1-0", "0-1-1"]
    assert groups.finished(["0-0-0"]) == []
    assert groups.to_withdraw() == ["0-0-1"]
    groups.came_back_open("0-0-1")
    assert groups.rollout_over
    done = ["0-1-0", "0-1-1", "0-0-0"]
    completions = {rid: response(rid, 4) for rid in done}
    carried = groups.carry_out(completions, dict.fromkeys(done, 1.0), {"0-0-1": 9})
    episode = OpenEpisode(request=groups.rollout[1], num_tokens=9)
    assert carried.groups[0].samples == (
        FinishedSample(response=completions["0-0-0"], reward=1.0),
        episode,
    )
    assert groups.generated_tokens(completions, {"0-0-1": 9}) == 3 * 4 + 9
    assert msgspec.json.decode(msgspec.json.encode(carried), type=CarryState) == carried

    played = IterationGroups(
        algorithm=algo(1, 1), carried=carried, fresh=fresh(1, 1), playing={"0-0-1"}
    )
    restarted = IterationGroups(algorithm=algo(1, 1), carried=carried, fresh=fresh(1, 1))
    for g in (played, restarted):
        assert g.rollout[0] == episode.request  # rolled out first
        assert g.admission.admitted == [0]  # carried once: due
    assert (played.tokens_before["0-0-1"], played.num_resumed, played.restarted) == (9, 1, [])
    assert restarted.tokens_before["0-0-1"] == 0
    assert (restarted.num_resumed, restarted.restarted) == (0, ["0-0-1"])


def test_an_open_episode_a_late_step_ended_carries_over_finished_and_its_group_is_whole() -> None:
    """An open episode whose environment step was still running when it was carried
    over, and then ended it (the runner's ``settle``): the carry turns it into a
    finished sample with its reward, the rest untouched, and the next iteration finds
    its group whole (trained first, nothing of it rolled out again)."""
    groups = IterationGroups(algorithm=algo(1, 1), carried=CarryState(), fresh=fresh(0, 2))
    groups.finished(["0-1-0", "0-1-1"])
    groups.finished(["0-0-0"])
    groups.came_back_open(groups.to_withdraw()[0])
    done = ["0-1-0", "0-1-1", "0-0-0"]
    completions = {rid: response(rid, 4) for rid in done}
    carried = groups.carry_out(completions, dict.fromkeys(done, 1.0), {"0-0-1": 9})
    assert carried.ended({}) is carried
    late = msgspec.structs.replace(response("0-0-1", 11), reward=0.25)
    ended = carried.ended({"0-0-1": late, "elsewhere": response("elsewhere", 2)})
    assert ended.groups[0].samples == (
        carried.groups[0].samples[0],
        FinishedSample(response=late, reward=0.25),
    )
    assert ended.groups[0].times_carried == carried.groups[0].times_carried
    following = IterationGroups(algorithm=algo(1, 1), carried=ended, fresh=fresh(1, 1))
    assert all(r.request_id != "0-0-1" for r in following.rollout)
    assert {e.request_id for e, _ in following.waiting} == {"0-0-0", "0-0-1"}
