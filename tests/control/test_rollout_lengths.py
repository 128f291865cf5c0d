"""What pending rollout requests are expected to generate: each request's progress
from its engine's reports, the survivors of the last iteration's lengths past it, and
the longest remaining response."""

import pytest

from dynarl.control import events as ev
from dynarl.control.demand import Demand, Rates
from dynarl.control.estimates import Estimates
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.rollout_lengths import (
    completion_order,
    expected_context,
    expected_longest_remaining,
    expected_remaining_tokens,
    mean_progress,
    pending_progress,
)
from dynarl.control.scoring import demands, finish_times
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT
from dynarl.core.errors import EventError, InvariantError
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .test_item_sizes import sized_graph
from .test_policies import predictor_for

E0 = InstanceId("rollout-0")
E1 = InstanceId("rollout-1")


def report(
    g: Hypergraph, running: int, tokens_per_s: float, t: float, engine: InstanceId = E0
) -> None:
    """``engine`` reports ``running`` requests and ``tokens_per_s`` since its last report."""
    g.apply(
        ev.EngineStats(
            instance=engine,
            kv_usage=0.1,
            num_running=running,
            num_queued=0,
            gen_tokens_per_s=tokens_per_s,
            time_s=t,
        )
    )


def progress_to(
    g: Hypergraph, tokens_per_request: float, pending: int, t0: float, engine: InstanceId = E0
) -> None:
    """``engine`` reports generating ``tokens_per_request`` per pending request over 1 s."""
    report(g, pending, 0.0, t0, engine)
    report(g, pending, tokens_per_request * pending, t0 + 1.0, engine)


def test_expected_remaining_is_the_survivors_mean_less_the_progress() -> None:
    g = sized_graph(expected_tokens=1000.0)
    lengths = [100, 200, 1000, 5000]
    refs = tuple(ev.ItemRef(ItemId(f"a{k}"), GroupId("g"), 10) for k in range(len(lengths)))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref, n in zip(refs, lengths, strict=True):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=ref.id, instance=E0, num_tokens=n))
    # During the first iteration: the prior (and at least the progress).
    assert expected_remaining_tokens(g, ROLLOUT) == pytest.approx(1000.0)

    g.apply(ev.IterationStarted(iteration=1, time_s=10.0))
    refs = (ev.ItemRef(ItemId("b0"), GroupId("h"), 10), ev.ItemRef(ItemId("b1"), GroupId("h"), 10))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    progress_to(g, 150.0, 2, t0=10.0)
    # Requests 150 tokens in: the last iteration's 200, 1000 and 5000 survive.
    assert expected_remaining_tokens(g, ROLLOUT) == pytest.approx((200 + 1000 + 5000) / 3 - 150)
    # At 1,150 tokens only the 5,000 survives; past the longest, a token is left at least.
    progress_to(g, 1000.0, 2, t0=11.0)
    assert expected_remaining_tokens(g, ROLLOUT) == pytest.approx(5000 - 1150)
    progress_to(g, 5000.0, 2, t0=12.0)
    assert expected_remaining_tokens(g, ROLLOUT) == pytest.approx(1.0)
    assert expected_longest_remaining(g, ROLLOUT) >= 1.0


def test_the_expected_remainder_is_each_requests_own_averaged_not_the_mean_requests() -> None:
    # Heavy-tailed lengths: nine in ten 1,000 tokens, one in ten 20,000. Two requests
    # 1,500 tokens in can only be long ones (18,500 left each); two not started yet
    # have the mean ahead (2,900). At their mean progress, 750, every length survives
    # and the remainder would read 2,150 for all four: a quarter of the work.
    g = sized_graph()
    finished_iteration(g, [1000] * 90 + [20_000] * 10)
    running = enqueue(g, ["r0", "r1"], t=10.0)
    for item in running:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0, time_s=10.0))
    progress_to(g, 1500.0, 2, t0=10.0)
    enqueue(g, ["w0", "w1"], t=11.0)  # waiting for a slot: nothing generated
    assert sorted(pending_progress(g, ROLLOUT)) == pytest.approx([0, 0, 1500, 1500])
    assert expected_remaining_tokens(g, ROLLOUT) == pytest.approx((2 * 2900 + 2 * 18_500) / 4)
    assert demands(g)[ROLLOUT].work == pytest.approx(4 * (2 * 2900 + 2 * 18_500) / 4)


def test_the_context_a_remaining_token_reads_weighs_the_long_survivors_most() -> None:
    g = sized_graph(expected_tokens=1000.0)
    finished_iteration(g, [100, 200, 1000, 5000])
    refs = (
        ev.ItemRef(ItemId("b0"), GroupId("h"), 300),
        ev.ItemRef(ItemId("b1"), GroupId("h"), 100),
    )
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    progress_to(g, 150.0, 2, t0=10.0)
    # Survivors past 150 have 50, 850 and 4850 left: a remaining token is on average
    # half-way into a remainder drawn by its length, E[r^2] / 2E[r].
    left = [50, 850, 4850]
    half = sum(r * r for r in left) / (2 * sum(left))
    assert expected_context(g, ROLLOUT) == pytest.approx(200 + 150 + half)
    # Past every length seen: as if each had the one token left it is expected to have.
    progress_to(g, 5000.0, 2, t0=11.0)
    assert expected_context(g, ROLLOUT) == pytest.approx(200 + 5150 + 0.5)


def enqueue(g: Hypergraph, names: list[str], t: float = 0.0) -> list[ItemId]:
    refs = tuple(ev.ItemRef(ItemId(n), GroupId("g"), 10) for n in names)
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs, time_s=t))
    return [r.id for r in refs]


def test_each_request_keeps_its_own_progress_across_engines_tools_and_requeues() -> None:
    g = sized_graph()
    a, b, c = enqueue(g, ["a", "b", "c"])
    g.apply(ev.ItemRouted(edge=PROMPTS, item=a, instance=E0))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=b, instance=E0))
    progress_to(g, 100.0, 2, t0=0.0)  # a and b gain 100 tokens each on rollout-0
    g.apply(ev.ItemRouted(edge=PROMPTS, item=c, instance=E0, time_s=1.0))
    progress_to(g, 50.0, 3, t0=1.0)  # c joins: a, b 150; c 50
    assert pending_progress(g, ROLLOUT) == pytest.approx([50.0, 150.0, 150.0])
    assert mean_progress(g, ROLLOUT) == pytest.approx(350.0 / 3)
    g.check()

    # a leaves for a tool call (its progress is kept while out), then runs on rollout-1.
    g.apply(ev.ToolCallStarted(edge=PROMPTS, item=a, instance=E0, prefix_tokens=160, time_s=2.0))
    assert pending_progress(g, ROLLOUT) == pytest.approx([50.0, 150.0, 150.0])  # a in a tool
    g.apply(ev.ToolCallFinished(edge=PROMPTS, item=a, time_s=2.5))
    assert pending_progress(g, ROLLOUT) == pytest.approx([50.0, 150.0, 150.0])  # a queued
    g.apply(ev.ItemRouted(edge=PROMPTS, item=a, instance=E1, time_s=2.5))
    progress_to(g, 20.0, 1, t0=2.5, engine=E1)
    progress_to(g, 10.0, 2, t0=3.0)  # b 160, c 60 on rollout-0
    assert pending_progress(g, ROLLOUT) == pytest.approx([60.0, 160.0, 170.0])
    g.check()

    # Requeued by a migration: the producer's exact counts replace the estimates.
    g.apply(ev.ItemsRequeued(edge=PROMPTS, items=(b, c), generated=(175, 58), time_s=4.5))
    assert pending_progress(g, ROLLOUT) == pytest.approx([58.0, 170.0, 175.0])
    g.apply(ev.ItemRouted(edge=PROMPTS, item=c, instance=E1, time_s=4.5))
    # One request runs on rollout-1: a, routed there first; c waits behind it.
    progress_to(g, 2.0, 1, t0=4.5, engine=E1)
    assert pending_progress(g, ROLLOUT) == pytest.approx([58.0, 172.0, 175.0])
    # a completes with 176 tokens: 4 since the last report, which the next one counts.
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=a, instance=E1, num_tokens=176, time_s=6.0))
    progress_to(g, 7.0, 1, t0=6.0, engine=E1)  # now c runs: of 7 tokens, 3 are its
    assert pending_progress(g, ROLLOUT) == pytest.approx([61.0, 175.0])
    g.check()

    # Without counts, a requeued request keeps the progress the reports gave it.
    g.apply(ev.ItemsRequeued(edge=PROMPTS, items=(c,), time_s=7.0))
    assert pending_progress(g, ROLLOUT) == pytest.approx([61.0, 175.0])
    g.check()


def test_a_requeue_with_the_wrong_number_of_counts_is_rejected_and_changes_nothing() -> None:
    g = sized_graph()
    a, b = enqueue(g, ["a", "b"])
    for item in (a, b):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0))
    with pytest.raises(EventError, match="one non-negative count per item"):
        g.apply(ev.ItemsRequeued(edge=PROMPTS, items=(a, b), generated=(5,)))
    with pytest.raises(EventError, match="one non-negative count per item"):
        g.apply(ev.ItemsRequeued(edge=PROMPTS, items=(a, b), generated=(5, -1)))
    assert all(g.edges[PROMPTS].items[i].owner == E0 for i in (a, b))
    g.check()


def test_the_invariant_check_catches_a_stale_progress_sum() -> None:
    g = sized_graph()
    (a,) = enqueue(g, ["a"])
    g.apply(ev.ItemRouted(edge=PROMPTS, item=a, instance=E0))
    g.instances[E0].progress_base += 7.0
    with pytest.raises(InvariantError, match="progress_base"):
        g.check()


def finished_iteration(g: Hypergraph, lengths: list[int]) -> None:
    """Complete requests of ``lengths`` and start iteration 1 (they become the survivors)."""
    ids = enqueue(g, [f"done{k}" for k in range(len(lengths))])
    for item, n in zip(ids, lengths, strict=True):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0))
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=item, instance=E0, num_tokens=n))
    g.apply(ev.IterationStarted(iteration=1, time_s=10.0))


def test_the_longest_remaining_is_set_by_the_least_advanced_request_that_may_hit_the_cap() -> None:
    # Last iteration: lengths 1,000 .. 9,000 and a tenth at the cap of 10,000.
    g = sized_graph()
    g.max_tokens_per_request = 10_000.0
    finished_iteration(g, [1000 * k for k in range(1, 10)] * 9 + [10_000] * 9)
    # Now: one request 2,000 tokens in (on rollout-1) and twenty 8,500 in (on rollout-0).
    late = enqueue(g, ["late"], t=10.0)[0]
    early = enqueue(g, [f"e{k}" for k in range(20)], t=10.0)
    for item in early:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0, time_s=10.0))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=late, instance=E1, time_s=10.0))
    progress_to(g, 8500.0, 20, t0=10.0)
    progress_to(g, 2000.0, 1, t0=10.0, engine=E1)
    assert mean_progress(g, ROLLOUT) == pytest.approx((20 * 8500 + 2000) / 21)
    longest = expected_longest_remaining(g, ROLLOUT)
    # The late request's survivors (3,000 .. 9,000 and the cap) leave it a median of
    # 4,000 more, longer than any of the others' 1,500: it sets the end. From the mean
    # progress (~8,200), even the cap would be only ~1,800 away.
    assert longest == pytest.approx(4000.0, rel=0.01)
    assert longest > 10_000 - mean_progress(g, ROLLOUT) + 2000

    # Once the late request is done, twenty requests at 8,500 (a survivor there is
    # 9,000 or the cap, half each): one of them almost surely reaches the cap.
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=late, instance=E1, num_tokens=2100, time_s=12.0))
    assert expected_longest_remaining(g, ROLLOUT) == pytest.approx(1500.0, rel=0.01)
    # A single survivor at 8,500 reaches the cap only half the time: the longest is no
    # less than a pending request's expected remaining length, 1,000.
    for item in early[1:]:
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=item, instance=E0, num_tokens=9000))
    assert expected_longest_remaining(g, ROLLOUT) == pytest.approx(1000.0)


def test_during_the_first_iteration_the_longest_runs_from_the_least_progress() -> None:
    g = sized_graph()
    g.max_tokens_per_request = 4000.0
    a, b = enqueue(g, ["a", "b"])
    g.apply(ev.ItemRouted(edge=PROMPTS, item=a, instance=E0))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=b, instance=E1))
    progress_to(g, 3000.0, 1, t0=0.0)
    progress_to(g, 500.0, 1, t0=0.0, engine=E1)
    assert expected_longest_remaining(g, ROLLOUT) == pytest.approx(3500.0)


def test_kept_estimates_answer_as_fresh_ones_and_are_computed_once_per_state() -> None:
    g = sized_graph()
    g.max_tokens_per_request = 4000.0
    ids = enqueue(g, [f"r{k}" for k in range(10)])
    for item in ids:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0))
    kept = Estimates()
    progress_to(g, 1000.0, 10, t0=0.0)
    assert expected_longest_remaining(g, ROLLOUT, kept) == pytest.approx(3000.0)
    report(g, 10, 10 * 500.0 / 0.5, 1.5)  # any event: the next answer is read afresh
    assert expected_longest_remaining(g, ROLLOUT, kept) == pytest.approx(2500.0)
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=ids[0], instance=E0, num_tokens=1500, time_s=1.5))
    assert expected_longest_remaining(g, ROLLOUT, kept) == pytest.approx(2500.0)
    progress_to(g, 100.0, 9, t0=2.0)
    assert expected_longest_remaining(g, ROLLOUT, kept) == pytest.approx(2400.0)
    assert expected_longest_remaining(g, ROLLOUT, kept) == expected_longest_remaining(g, ROLLOUT)
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return len(calls)

    assert kept.get(g, "probe", count) == kept.get(g, "probe", count) == 1
    report(g, 9, 0.0, 4.0)
    assert kept.get(g, "probe", count) == 2  # a new state of the graph: computed again
    assert kept.get(sized_graph(), "probe", count) == 3  # another graph


def test_requests_queued_inside_an_engine_make_no_progress_and_the_sum_is_what_it_reported() -> (
    None
):
    g = sized_graph()
    a, b, c = enqueue(g, ["a", "b", "c"])
    for item in (a, b, c):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0))
    progress_to(g, 100.0, 2, t0=0.0)  # two run (a and b, the first routed); c waits
    assert pending_progress(g, ROLLOUT) == pytest.approx([0.0, 100.0, 100.0])
    # KV runs short: one is preempted; the 60 tokens of the window still sum exactly.
    report(g, 1, 60.0, 2.0)
    assert sum(pending_progress(g, ROLLOUT)) == pytest.approx(260.0)
    assert mean_progress(g, ROLLOUT) == pytest.approx(260.0 / 3)
    # The preempted one waits: it gains nothing while the one running gains 40.
    before = pending_progress(g, ROLLOUT)
    report(g, 1, 40.0, 3.0)
    after = pending_progress(g, ROLLOUT)
    assert sorted(b - a for a, b in zip(before, after, strict=True)) == pytest.approx([0, 0, 40])
    g.check()
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=a, instance=E0, num_tokens=170, time_s=3.0))
    g.check()


def test_requests_complete_short_remainders_first_and_the_longest_at_the_end() -> None:
    g = sized_graph()
    g.max_tokens_per_request = 10_000.0
    assert completion_order(g, ROLLOUT) is None  # no finished iteration yet
    finished_iteration(g, [1000 * k for k in range(1, 11)] * 10)  # 1,000 .. 10,000
    # 32 requests, none started: each ends at one of the lengths seen, equally likely.
    ids = enqueue(g, [f"p{k}" for k in range(32)], t=10.0)
    for item in ids:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0, time_s=10.0))
    order = completion_order(g, ROLLOUT)
    assert order is not None and len(order.time) == len(order.length) == 16
    assert list(order.time) == sorted(order.time) and order.time[-1] == 1.0
    assert list(order.length) == sorted(order.length)
    assert order.length[0] == pytest.approx(1000.0) and order.length[-1] == pytest.approx(10_000.0)
    # A response of L ends L / longest of the way: the first sixteenth at 1,000 tokens.
    longest = expected_longest_remaining(g, ROLLOUT)
    assert order.time[0] == pytest.approx(1000.0 / longest)
    # 6,000 tokens in, only the lengths past it remain: 7,000 .. 10,000.
    progress_to(g, 6000.0, 32, t0=10.0)
    later = completion_order(g, ROLLOUT)
    assert later is not None and min(later.length) == pytest.approx(7000.0)
    assert later.time[0] == pytest.approx(1000.0 / expected_longest_remaining(g, ROLLOUT))


def test_a_stage_fed_by_the_rollout_is_predicted_to_work_through_its_inputs_as_they_arrive() -> (
    None
):
    # Heavy-tailed lengths: most of the scoring work comes with the last, longest
    # responses. Inference's work arrives in the rollout's completion order, each
    # chunk's share by its samples' length, and it cannot get ahead of it: sized to
    # its total work it would idle early and finish late, after the rollout's last
    # chunk by at least that chunk's work.
    g = sized_graph()
    g.max_tokens_per_request = 10_000.0
    finished_iteration(g, [1000 * k for k in range(1, 11)] * 10)  # 1,000 .. 10,000
    ids = enqueue(g, [f"p{k}" for k in range(32)], t=10.0)
    for k, item in enumerate(ids):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=(E0, E1)[k % 2], time_s=10.0))
    predictor = predictor_for(g)
    demand = demands(g)
    d = demand[INFERENCE]
    shares = [share for share, _ in d.arriving]
    work = [w for _, w in d.arriving]
    assert len(d.arriving) == 16 and shares == sorted(shares) and shares[-1] == 1.0
    assert sum(work) == pytest.approx(d.upstream)
    assert work == sorted(work) and work[-1] > 5 * work[0]  # the longest come last
    devices = {ROLLOUT: 2, INFERENCE: 1, ACTOR: 1}
    finish = finish_times(g, predictor, devices, demand=demand)
    rate = Rates(g, predictor)(INFERENCE, 1, d)
    assert finish[INFERENCE] >= finish[ROLLOUT] + work[-1] / rate
    # Taken as if its work were all here, inference would be predicted done sooner.
    evenly = dict(demand)
    evenly[INFERENCE] = Demand(work=d.work, load=d.load, tail=d.tail, upstream=d.upstream)
    assert finish_times(g, predictor, devices, demand=evenly)[INFERENCE] < finish[INFERENCE]


def test_the_trainers_steps_hold_the_work_the_rollouts_requests_are_expected_to_make() -> None:
    # Last iteration's lengths 1,000 .. 10,000 (mean 5,500). Eight groups of four
    # requests, none started: the groups that end last make the last step (a group's
    # requests are taken as long as the response that ends it), but in all the steps
    # hold what 32 requests of the mean length make, not 32 of the groups' longest.
    g = sized_graph(actor_steps=2, arrival_order=True)
    g.max_tokens_per_request = 10_000.0
    finished_iteration(g, [1000 * k for k in range(1, 11)] * 10)
    refs = tuple(ev.ItemRef(ItemId(f"p{k}"), GroupId(f"g{k // 4}"), 10) for k in range(32))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs, time_s=10.0))
    d = demands(g)[ACTOR]
    assert len(d.steps) == 2
    assert sum(d.steps) == pytest.approx(32 * (10 + 5500.0))
    assert sum(d.steps) == pytest.approx(d.work, rel=0.01)
