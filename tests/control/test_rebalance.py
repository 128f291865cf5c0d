"""Instance-level rebalancing of the rollout tail: hot engines spread over idle ones."""

import pytest

from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.demand import Demand, Rates, rate
from dynarl.control.estimates import Estimates
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.policies.rebalance import RebalanceTail
from dynarl.control.scoring import demands, remaining_time, score_plan
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .graphs import make_graph
from .test_policies import predictor_for, tick


def skewed(loads: list[int], *, queued: int = 0) -> Hypergraph:
    """Rollout engines holding ``loads[k]`` requests each (whole groups on one engine,
    as the router sends them), plus ``queued`` requests waiting for a slot."""
    g = make_graph(rollout=len(loads), inference=1, actor=1)
    g.apply(ev.IterationStarted(iteration=0))
    for k, n in enumerate(loads):
        iid = InstanceId(f"rollout-{k}")
        refs = tuple(ev.ItemRef(ItemId(f"r{k}-{j}"), GroupId(f"g{k}")) for j in range(n))
        g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
        for ref in refs:
            g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=iid))
        g.apply(
            ev.EngineStats(instance=iid, kv_usage=min(1.0, 0.01 * n), num_running=n, num_queued=0)
        )
    if queued:
        refs = tuple(ev.ItemRef(ItemId(f"q{j}"), GroupId("gq")) for j in range(queued))
        g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    return g


def test_a_hot_engines_requests_are_spread_one_by_one_and_it_restarts_in_place() -> None:
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1])
    plan = RebalanceTail(SchedulerConfig(), predictor_for(g)).decide(g, tick(5.0))
    assert plan and plan.score_after < plan.score_before
    (m,) = plan.migrations
    hot = g.instances[InstanceId("rollout-0")]
    assert (m.src, m.dst, m.drain) == (ROLLOUT, ROLLOUT, (hot.id,))
    assert [s.devices for s in m.create] == [hot.devices]  # restarted on its own device
    # Its one group is split: every request goes somewhere else, evenly.
    assert sorted(i for i, _ in m.reassign) == sorted(hot.items)
    others = [k for k in g.components[ROLLOUT].instances if k != hot.id]
    per_target = [sum(1 for _, t in m.reassign if t == k) for k in others]
    assert max(per_target) - min(per_target) <= 1 and sum(per_target) == 64
    g.apply(ev.MigrationStarted(migration=m))
    g.apply(ev.ItemsRequeued(edge=PROMPTS, items=tuple(i for i, _ in m.reassign)))
    for item, target in m.reassign:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=target))
    g.apply(ev.MigrationDone(migration=m.id))
    g.check()
    loads = [len(n.items) for n in g.components[ROLLOUT].active_instances()]
    assert max(loads) <= 11 and g.components[ROLLOUT].num_active == 8


def test_balanced_engines_or_waiting_requests_are_left_alone() -> None:
    cfg = SchedulerConfig()
    g = skewed([6, 6, 6, 6, 6, 6])
    assert not RebalanceTail(cfg, predictor_for(g)).decide(g, tick(5.0))
    # Requests waiting for a slot will fill the light engines by themselves.
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1], queued=4)
    assert not RebalanceTail(cfg, predictor_for(g)).decide(g, tick(5.0))


def test_scoring_sees_the_most_loaded_engine_only_when_asked() -> None:
    """The same requests finish later when one engine holds them all; a spread plan is
    scored on where its requests go."""
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1])
    predictor = predictor_for(g)
    before = {c: n.num_active_devices for c, n in g.components.items()}
    balanced = remaining_time(g, predictor, before)
    skew = remaining_time(g, predictor, before, demand=demands(g, per_engine=True))
    assert skew > balanced
    plan = RebalanceTail(SchedulerConfig(), predictor).decide(g, tick(5.0))
    spread = score_plan(g, predictor, plan, before, demands(g, per_engine=True))
    assert spread == plan.score_after < skew


@pytest.mark.parametrize(
    "loads",
    [
        [64, 60, 56, 52, 2, 2, 2, 2],
        [128, 128, 70, 70, 1, 1, 1, 1],
        [128, 100, 64, 40, 30, 20, 10, 1],
        [128 - 8 * i for i in range(16)] + [2] * 16,
    ],
)
def test_a_spread_leaves_every_engine_lighter_than_the_engines_it_drains(
    loads: list[int],
) -> None:
    """A spread that only moved the hot engines' load onto others (which then are as
    hot, while the restarted ones are empty) would be swapped back on the next tick:
    every engine a spread sends requests to ends lighter than the drained engines were
    on average."""
    g = skewed(loads)
    plan = RebalanceTail(SchedulerConfig(), predictor_for(g)).decide(g, tick(5.0))
    for m in plan.migrations:
        drained = [len(g.instances[i].items) for i in m.drain]
        targets = [t for _, t in m.reassign]
        after = [len(g.instances[k].items) + targets.count(k) for k in set(targets)]
        assert max(after) < sum(drained) / len(drained)


def test_no_spread_while_sessions_are_in_a_tool_call() -> None:
    """A session in a tool call comes back to the engine holding its KV prefix; a
    spread would restart engines and lose those prefixes, so the tail is left alone
    until no session is in a tool."""
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1])
    assert RebalanceTail(SchedulerConfig(), predictor_for(g)).decide(g, tick(5.0))
    g.apply(
        ev.ToolCallStarted(
            edge=PROMPTS, item=ItemId("r1-0"), instance=InstanceId("rollout-1"), prefix_tokens=9
        )
    )
    assert not RebalanceTail(SchedulerConfig(), predictor_for(g)).decide(g, tick(5.0))


def with_kv_usage(g: Hypergraph, usage: dict[int, float]) -> Hypergraph:
    """Engines ``rollout-k`` report ``usage[k]`` KV usage (their loads unchanged)."""
    for k, kv in usage.items():
        node = g.instances[InstanceId(f"rollout-{k}")]
        g.apply(
            ev.EngineStats(instance=node.id, kv_usage=kv, num_running=len(node.items), num_queued=0)
        )
    return g


@pytest.mark.parametrize("usage", [0.2, 0.5, 0.95])
def test_no_spread_when_no_engine_has_room(usage: float) -> None:
    """Every engine at or above u_low: the moved requests would only wait and
    re-prefill on engines as full as their own."""
    cfg = SchedulerConfig(u_low=0.2)
    g = with_kv_usage(skewed([64, 1, 1, 1, 1, 1, 1, 1]), dict.fromkeys(range(8), usage))
    assert not RebalanceTail(cfg, predictor_for(g)).decide(g, tick(5.0))


def test_one_engine_with_room_is_enough_to_spread() -> None:
    cfg = SchedulerConfig(u_low=0.2)
    usage = dict.fromkeys(range(8), 0.5) | {7: 0.19}
    g = with_kv_usage(skewed([64, 1, 1, 1, 1, 1, 1, 1]), usage)
    plan = RebalanceTail(cfg, predictor_for(g)).decide(g, tick(5.0))
    assert plan and plan.score_after < plan.score_before
    assert {i for m in plan.migrations for i in m.drain} == {InstanceId("rollout-0")}


def test_per_engine_demands_differ_from_the_plain_ones_only_in_the_hottest_engine() -> None:
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1])
    est = Estimates()
    plain, hot = demands(g, estimates=est), demands(g, per_engine=True, estimates=est)
    assert hot is demands(g, per_engine=True, estimates=est)  # once per state
    fields = [f for f in Demand.__slots__ if f != "hottest"]
    for cid, d in plain.items():
        assert [getattr(hot[cid], f) for f in fields] == [getattr(d, f) for f in fields]
        assert d.hottest == 0.0
    assert hot[ROLLOUT].hottest == 64 * plain[ROLLOUT].per_item > 0
    # A fresh memo computes the same: nothing is carried from the plain demands.
    assert demands(g, per_engine=True)[ROLLOUT].hottest == hot[ROLLOUT].hottest


def test_rates_memo_answers_what_rate_answers() -> None:
    g = skewed([64, 1, 1, 1, 1, 1, 1, 1])
    predictor = predictor_for(g)
    d = demands(g, per_engine=True)[ROLLOUT]
    memo = Rates(g, predictor)
    for n in (1, 4, 8, 4):
        assert memo(ROLLOUT, n, d) == rate(g, predictor, ROLLOUT, n, d)
    other = d.with_hottest(1)  # another demand: not handed the first one's answer
    assert memo(ROLLOUT, 8, other) == rate(g, predictor, ROLLOUT, 8, other)
    assert memo(ROLLOUT, 8, other) != memo(ROLLOUT, 8, d)
