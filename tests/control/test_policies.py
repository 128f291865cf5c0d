"""Scheduling decisions on hand-built states: donors, valid sizes, scoring, modes."""

from typing import Literal

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.modes import make_policy
from dynarl.control.plan import Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.bottleneck import BottleneckPolicy, _amounts, _Sizes
from dynarl.control.policies.colocated import ColocatedPolicy
from dynarl.control.policies.donors import spare_engines, underused_engines
from dynarl.control.policies.phases import ActorTakesCluster, RolloutBorrowsActor
from dynarl.control.policies.rlhfuse import RlhfusePolicy
from dynarl.control.policies.starved import StarvedStage
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import PrefillCost, Profile
from dynarl.control.scheduler import Trigger, TriggerKind
from dynarl.control.scoring import demands, remaining_time, score_plan
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT, TO_ACTOR, TO_INFERENCE
from dynarl.core.ids import EdgeId, GroupId, InstanceId, ItemId

from .graphs import carry_out, make_graph


def predictor_for(
    graph: Hypergraph, *, actor_rate: float = 10.0, profile: Profile | None = None
) -> Predictor:
    """A predictor fitted to a known world: decode step 20 ms + 0.5 ms per sequence per
    device; inference 100 and actor ``actor_rate`` items/s per device."""
    p = Predictor({c: n.spec.scaling for c, n in graph.components.items()}, profile=profile)
    for n in (1, 2, 4, 8):
        for load in (1, 8, 64):
            p.observe(ROLLOUT, n, load, load / (0.02 + 0.0005 * load / n))
        p.observe(INFERENCE, n, 512, 100.0 * n)
        p.observe(ACTOR, n, 512, actor_rate * n)
    return p


def enqueue(g: Hypergraph, edge: EdgeId, n: int, prefix: str) -> list[ItemId]:
    items = [ItemId(f"{prefix}{k}") for k in range(n)]
    g.apply(ev.ItemsEnqueued(edge=edge, items=tuple(ev.ItemRef(i, GroupId(i)) for i in items)))
    return items


def tail_state(*, low_engines: int, engines: int = 5, t0: float = 0.0) -> Hypergraph:
    """Rollout at its tail: one request per engine, ``low_engines`` of them reporting
    KV usage below u_low since ``t0``; 2000 samples (most of 4 minibatches) wait for
    the actor, more than it can train before the tail ends."""
    g = make_graph(
        rollout=engines, inference=1, actor=1, actor_sizes=(1, 2, 3, 4, 5, 6), actor_steps=4
    )
    g.apply(ev.IterationStarted(iteration=0, time_s=t0))
    for k, item in enumerate(enqueue(g, PROMPTS, engines, "r")):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=InstanceId(f"rollout-{k}")))
    enqueue(g, TO_ACTOR, 2000, "a")
    report_tail(g, low_engines=low_engines, engines=engines, t=t0)
    return g


def report_tail(g: Hypergraph, *, low_engines: int, engines: int, t: float) -> None:
    """Each engine reports its one request running at 40 tokens/s at ``t``, the first
    ``low_engines`` at KV usage 0.05, the others at 0.6."""
    for k in range(engines):
        g.apply(
            ev.EngineStats(
                instance=InstanceId(f"rollout-{k}"),
                kv_usage=0.05 if k < low_engines else 0.6,
                num_running=1,
                num_queued=0,
                gen_tokens_per_s=40.0,
                time_s=t,
            )
        )


def tick(t: float, kind: TriggerKind = "tick") -> Trigger:
    return Trigger(kind=kind, time_s=t)


def test_engines_are_under_used_only_after_T_seconds_below_u_low_on_more_than_theta() -> None:
    cfg = SchedulerConfig(theta=0.7, donor_window_s=4.0, u_low=0.2)
    g = tail_state(low_engines=4)
    assert underused_engines(g, ROLLOUT, cfg, 3.9) == 0  # 4/5 low, not yet for T seconds
    assert underused_engines(g, ROLLOUT, cfg, 4.0) == 4
    g = tail_state(low_engines=3)  # 60% low: not more than theta
    assert underused_engines(g, ROLLOUT, cfg, 100.0) == 0


def test_spare_engines_are_those_the_requests_do_not_need_packed_to_70_percent() -> None:
    g = tail_state(low_engines=4)  # KV usage 4 x 0.05 + 0.6 = 0.8 engines' worth
    assert spare_engines(g, ROLLOUT) == 5 - 2
    g = tail_state(low_engines=0)  # 5 x 0.6: all five are needed
    assert spare_engines(g, ROLLOUT) == 0
    g = tail_state(low_engines=4)
    enqueue(g, PROMPTS, 1, "waiting")  # a request waits for a slot: none to spare
    assert spare_engines(g, ROLLOUT) == 0


def test_a_rollout_gives_the_engines_its_requests_do_not_need_when_it_pays() -> None:
    cfg = SchedulerConfig(theta=0.7, donor_window_s=4.0, u_low=0.2)
    g = tail_state(low_engines=4)
    plan = BottleneckPolicy(cfg, predictor_for(g)).decide(g, tick(1.0))  # before T
    assert plan and all(m.src == ROLLOUT and m.dst == ACTOR for m in plan.migrations)
    drained = {i for m in plan.migrations for i in m.drain}
    assert drained <= {InstanceId(f"rollout-{k}") for k in range(4)}  # never the busy one
    assert len(drained) <= 3
    assert plan.score_after < plan.score_before
    g = tail_state(low_engines=0)  # every engine needed, none under-used
    assert not BottleneckPolicy(cfg, predictor_for(g)).decide(g, tick(100.0))


@pytest.mark.parametrize("completion_order", [True, False])
def test_a_trainer_idle_before_its_last_minibatch_is_a_donor(completion_order: bool) -> None:
    """In completion order the last minibatch holds the iteration's last groups, so a
    trainer with only that step left waits for the rollout whatever samples it holds:
    its devices are offered (all but one instance). Not before an earlier step, not
    while a step runs, not once nothing is upstream, and not when minibatches are
    drawn from the whole iteration."""
    g = make_graph(
        rollout=2,
        inference=1,
        actor=4,
        actor_steps=4,
        actor_steps_in_arrival_order=completion_order,
    )
    g.apply(ev.IterationStarted(iteration=0, time_s=0.0))
    enqueue(g, PROMPTS, 8, "r")  # the rollout's last requests: work upstream
    queued = enqueue(g, TO_ACTOR, 6, "a")  # samples of the last minibatch, not all of it
    policy = BottleneckPolicy(SchedulerConfig(), predictor_for(g))

    def offered() -> int:
        return policy.donatable(g, ACTOR, demands(g)[ACTOR], 1.0)

    for step in range(3):
        assert offered() == 0  # an earlier minibatch may complete any moment
        g.apply(
            ev.TrainStepDone(component=ACTOR, step=step, num_steps=4, num_samples=8, duration_s=1.0)
        )
    assert offered() == (3 if completion_order else 0)
    g.apply(ev.ItemRouted(edge=TO_ACTOR, item=queued[0], instance=InstanceId("actor-0")))
    assert offered() == 0  # a step runs


def test_a_trainer_before_its_last_minibatch_with_nothing_upstream_is_no_donor() -> None:
    g = make_graph(
        rollout=2, inference=1, actor=4, actor_steps=4, actor_steps_in_arrival_order=True
    )
    g.apply(ev.IterationStarted(iteration=0, time_s=0.0))
    enqueue(g, TO_ACTOR, 8, "a")  # the whole last minibatch is here: its step starts
    for step in range(3):
        g.apply(
            ev.TrainStepDone(component=ACTOR, step=step, num_steps=4, num_samples=8, duration_s=1.0)
        )
    policy = BottleneckPolicy(SchedulerConfig(), predictor_for(g))
    assert policy.donatable(g, ACTOR, demands(g)[ACTOR], 1.0) == 0


def test_a_plan_the_predictor_scores_worse_is_never_committed() -> None:
    cfg = SchedulerConfig(theta=0.5, donor_window_s=0.0)
    g = tail_state(low_engines=5)
    # The actor is so fast that its 2000 samples take no time: moving rollout engines
    # can only slow rollout down (and costs a migration).
    fast_actor = predictor_for(g, actor_rate=1e6)
    assert not BottleneckPolicy(cfg, fast_actor).decide(g, tick(10.0))
    # Without a fitted model the policy does not act on guesses.
    blank = Predictor({c: n.spec.scaling for c, n in g.components.items()})
    assert not BottleneckPolicy(cfg, blank).decide(g, tick(10.0))


def random_state(data: st.DataObject) -> Hypergraph:
    g = make_graph(
        rollout=data.draw(st.integers(1, 6)),
        inference=data.draw(st.integers(0, 2)),
        actor=data.draw(st.sampled_from([0, 1, 2])),
        free=data.draw(st.integers(0, 2)),
        actor_sizes=(1, 2, 4),
    )
    g.apply(ev.IterationStarted(iteration=0))
    for edge, prefix in ((PROMPTS, "p"), (TO_INFERENCE, "i"), (TO_ACTOR, "a")):
        items = enqueue(g, edge, data.draw(st.integers(0, 40)), prefix)
        consumers = [
            n for c in g.edges[edge].spec.consumers for n in g.components[c].active_instances()
        ]
        for item in items:
            if consumers and data.draw(st.booleans()):
                node = data.draw(st.sampled_from(consumers))
                g.apply(ev.ItemRouted(edge=edge, item=item, instance=node.id))
    for node in list(g.components[ROLLOUT].active_instances()):
        g.apply(
            ev.EngineStats(
                instance=node.id,
                kv_usage=data.draw(st.floats(0, 1)),
                num_running=len(node.items),
                num_queued=0,
                gen_tokens_per_s=data.draw(st.floats(0, 500)),
            )
        )
    return g


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_committed_plans_strictly_improve_and_keep_the_actor_valid(data: st.DataObject) -> None:
    g = random_state(data)
    cfg = SchedulerConfig(theta=data.draw(st.floats(0.1, 1.0)), donor_window_s=0.0)
    predictor = predictor_for(g)
    plan = BottleneckPolicy(cfg, predictor).decide(g, tick(data.draw(st.floats(0, 50))))
    if not plan:
        return
    assert plan.score_after < plan.score_before * (1 - cfg.min_gain)
    before = {c: n.num_active_devices for c, n in g.components.items()}
    assert plan.score_before == pytest.approx(remaining_time(g, predictor, before))
    carry_out(g, plan)
    assert g.components[ACTOR].spec.is_valid_size(g.components[ACTOR].num_active)


def test_actor_takes_the_cluster_at_its_largest_valid_size_once_alone_with_work() -> None:
    g = make_graph(rollout=4, inference=2, actor=1, free=1, actor_sizes=(1, 2, 4))
    enqueue(g, TO_ACTOR, 64, "a")
    item = enqueue(g, TO_INFERENCE, 1, "i")[0]
    policy = ActorTakesCluster()
    assert not policy.decide(g, tick(1.0, "stage_drained"))  # inference still has work
    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=item, instance=InstanceId("inference-0")))
    g.apply(ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(ItemId("a-last"), GroupId("g")),)))
    g.apply(ev.ItemCompleted(edge=TO_INFERENCE, item=item, instance=InstanceId("inference-0")))
    plan = policy.decide(g, tick(2.0, "stage_drained"))
    assert plan
    carry_out(g, plan)
    assert g.components[ACTOR].num_active == 4  # 8 devices, but 8 replicas is not valid


@pytest.mark.parametrize("phase", ["both", "start", "return"])
def test_rollout_borrows_the_actor_at_iteration_start_and_returns_it_for_the_tail(
    phase: Literal["both", "start", "return"],
) -> None:
    g = make_graph(rollout=2, inference=1, actor=2)
    cfg = SchedulerConfig(borrow_return_fraction=0.25, donor_window_s=2.0)
    policy = RolloutBorrowsActor({ROLLOUT: 2, INFERENCE: 1, ACTOR: 2}, cfg)
    only = RolloutBorrowsActor({ROLLOUT: 2, INFERENCE: 1, ACTOR: 2}, cfg, phase=phase)
    g.apply(ev.IterationStarted(iteration=0))
    plan = policy.decide(g, tick(0.0, "iteration_start"))
    assert bool(only.decide(g, tick(0.0, "iteration_start"))) == (phase != "return")
    assert [(m.src, m.dst, len(m.create)) for m in plan.migrations] == [(ACTOR, ROLLOUT, 2)]
    carry_out(g, plan)
    items = enqueue(g, PROMPTS, 8, "p")
    assert not policy.decide(g, tick(1.0))  # 8/8 outstanding: keep borrowing
    engines = sorted(g.components[ROLLOUT].instances)
    for k, item in enumerate(items[:6]):
        inst = engines[k % 4]
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=inst))
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=item, instance=inst))
    for k, item in enumerate(items[6:]):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=engines[k]))

    def stats(t: float, kv: float) -> None:
        for inst in engines:
            g.apply(
                ev.EngineStats(instance=inst, time_s=t, kv_usage=kv, num_running=1, num_queued=0)
            )

    # 2/8 outstanding <= 25%, but the engines' KV caches are still full (long
    # requests): taking engines away would slow the tail, so they stay.
    stats(2.0, 0.9)
    assert not policy.decide(g, tick(5.0))
    # Under-used for the donor window on every engine: hand back the surplus.
    stats(6.0, 0.05)
    assert not policy.decide(g, tick(7.0))  # not yet for 2 s
    plan = policy.decide(g, tick(8.5))
    assert [(m.src, m.dst) for m in plan.migrations] == [(ROLLOUT, ACTOR)]
    assert sum(len(s.devices) for m in plan.migrations for s in m.create) == 2
    assert bool(only.decide(g, tick(8.5))) == (phase != "start")


ALL_TRIGGERS: list[TriggerKind] = [
    "tick",
    "step_boundary",
    "iteration_start",
    "iteration_end",
    "stage_drained",
    "placement_changed",
]


def test_colocated_moves_devices_only_at_stage_boundaries() -> None:
    g = make_graph(rollout=2, inference=1, actor=1)
    enqueue(g, PROMPTS, 4, "p")
    policy = ColocatedPolicy()
    for kind in ALL_TRIGGERS:
        plan = policy.decide(g, tick(1.0, kind))
        boundary = kind in ("iteration_start", "stage_drained", "placement_changed")
        assert bool(plan) == boundary, kind
    plan = policy.decide(g, tick(1.0, "iteration_start"))
    carry_out(g, plan)
    assert g.components[ROLLOUT].num_active_devices == 4
    assert not policy.decide(g, tick(2.0, "stage_drained"))  # rollout still has work


def test_rlhfuse_fuses_only_when_the_tail_fits_on_few_engines_without_slowing() -> None:
    """One request per engine: while every engine reads as much KV as the busiest,
    packing them would slow each decode step, so nothing fuses; once one engine holds
    most of the KV, the rest fit on 2 of 10 engines and the other 8 start inference."""

    def tail(kv: list[float]) -> Hypergraph:
        g = make_graph(rollout=len(kv), inference=0, actor=0)
        g.apply(ev.IterationStarted(iteration=0))
        for k, item in enumerate(enqueue(g, PROMPTS, len(kv), "r")):
            iid = InstanceId(f"rollout-{k}")
            g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=iid))
            g.apply(ev.EngineStats(instance=iid, kv_usage=kv[k], num_running=1, num_queued=0))
        return g

    policy = RlhfusePolicy(tail_fraction=0.2)
    assert not policy.decide(tail([0.5] * 10), tick(1.0))
    plan = policy.decide(tail([0.6] + [0.05] * 9), tick(1.0))
    assert [(m.src, m.dst, len(m.drain)) for m in plan.migrations] == [(ROLLOUT, INFERENCE, 8)]
    assert InstanceId("rollout-0") not in plan.migrations[0].drain


def test_disaggregated_keeps_its_split_and_only_reboots_crashed_devices() -> None:
    g = tail_state(low_engines=5)
    baseline = {c: n.num_active_devices for c, n in g.components.items() if n.spec.on_devices}
    policy = make_policy(
        SchedulerConfig(mode="static-disaggregated", rollout_borrows_actor=False),
        predictor_for(g),
        baseline,
    )
    for kind in ALL_TRIGGERS:
        assert not policy.decide(g, tick(100.0, kind)), kind
    g.apply(ev.WorkerFailed(instance=InstanceId("rollout-1"), reason="oom"))
    plan = policy.decide(g, tick(101.0, "placement_changed"))
    assert [(m.kind, m.dst, len(m.create)) for m in plan.migrations] == [("reboot", ROLLOUT, 1)]


def test_modes_are_a_table_of_policies() -> None:
    g = make_graph()
    for mode in ("dynamic", "static-colocated", "static-disaggregated"):
        policy = make_policy(
            msgspec.structs.replace(SchedulerConfig(), mode=mode), predictor_for(g), {}
        )
        assert policy.name == mode


def test_a_donor_is_offered_one_half_all_then_halvings() -> None:
    # A 26-engine rollout's best move may be 4 engines, between one and half; the first
    # three stay one, half and all, which a small candidate budget must not crowd out.
    assert _amounts(26) == [1, 13, 26, 6, 3]
    assert _amounts(8) == [1, 4, 8, 2]
    assert _amounts(1) == [1]


def test_a_donor_is_charged_the_re_prefill_of_the_requests_it_moves() -> None:
    # Moving two of five tail engines sends their requests (40 tokens generated each)
    # to the three kept engines, which stall to re-prefill them: the rollout (here the
    # last to finish: the actor is fast) loses at least the migration's flat cost,
    # more when the contexts are dear to prefill.
    g = tail_state(low_engines=4)
    report_tail(g, low_engines=4, engines=5, t=1.0)  # a second of decoding
    before = {c: n.num_active_devices for c, n in g.components.items()}
    builder = PlanBuilder(g)
    assert builder.move(ROLLOUT, ACTOR, drain=2)
    plan = builder.build("move two engines")
    cheap = predictor_for(g, actor_rate=1e6)
    dear_prefill = PrefillCost(s_per_token=3.0, s_per_token_context=0.0, kv_capacity_tokens=1e6)
    dear = predictor_for(g, actor_rate=1e6, profile=Profile(prefill={ROLLOUT: dear_prefill}))
    stall = 2 * dear_prefill.seconds(40) / 3  # two requests re-prefilled on three engines
    assert stall > dear.migration_cost("workload")
    flat = score_plan(g, cheap, plan, before)
    assert score_plan(g, dear, plan, before) == pytest.approx(
        flat - cheap.migration_cost("workload") + stall, rel=0.05
    )


def test_a_starved_stage_takes_the_bottleneck_plan_when_that_starts_it_too() -> None:
    """Inference has work and no device, the rollout's engines nothing left: the floor
    alone starts one replica, and growing it would wait for that move to end; with the
    bottleneck policy behind it, the stage gets the bottleneck's plan in one move."""
    g = make_graph(rollout=4, inference=0, actor=2)
    enqueue(g, TO_INFERENCE, 512, "i")
    predictor = predictor_for(g)
    floor = StarvedStage()
    plan = floor.decide(g, tick(1.0, "stage_drained"))
    assert [(m.src, m.dst, len(m.create)) for m in plan.migrations] == [(ROLLOUT, INFERENCE, 1)]
    bottleneck = BottleneckPolicy(SchedulerConfig(), predictor)
    fuller = StarvedStage(fuller=bottleneck).decide(g, tick(1.0, "stage_drained"))
    assert fuller == bottleneck.decide(g, tick(1.0, "stage_drained"))
    assert sum(len(m.create) for m in fuller.migrations if m.dst == INFERENCE) > 1
    dynamic = make_policy(SchedulerConfig(), predictor, {}).decide(g, tick(1.0, "stage_drained"))
    assert dynamic == fuller


def test_a_starved_stage_gets_its_floor_when_the_bottleneck_plan_leaves_it_starved() -> None:
    """A fuller plan that does not start the starved stage is not taken: the stage
    would wait for it to end, and then for its own start."""

    class Elsewhere:
        name = "elsewhere"

        def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
            builder = PlanBuilder(graph)
            builder.gather(ACTOR, graph.components[ACTOR].num_active + 1, [ROLLOUT])
            return builder.build("rollout -> actor")

    g = make_graph(rollout=4, inference=0, actor=2)
    enqueue(g, TO_INFERENCE, 512, "i")
    assert Elsewhere().decide(g, tick(1.0))
    plan = StarvedStage(fuller=Elsewhere()).decide(g, tick(1.0, "stage_drained"))
    assert plan.reason == "inference has work and no device: start it"


def test_a_donor_with_work_gives_whole_instances_of_its_receiver() -> None:
    """Four-device engines giving to 8-device inference replicas: seven would make
    three replicas and leave four devices to the free pool, which the model counts as
    lost; a rollout with work left gives six and keeps the seventh working. A donor
    with no work left gives what it was asked (its devices idle either way), and so
    does a move whose leftover comes from the receiver's valid sizes, not its unit
    (the next decision hands those on)."""
    g = make_graph(rollout=40, rollout_tp=4, inference=8, inference_tp=8, actor=16)
    assert _Sizes(g, {}, working={ROLLOUT})(ROLLOUT, INFERENCE, 7) == (ROLLOUT, INFERENCE, 6)
    assert _Sizes(g, {}, working={ROLLOUT})(ROLLOUT, INFERENCE, 8) == (ROLLOUT, INFERENCE, 8)
    assert _Sizes(g, {}, working=set())(ROLLOUT, INFERENCE, 7) == (ROLLOUT, INFERENCE, 7)
    assert _Sizes(g, {}, working={ROLLOUT})(ROLLOUT, INFERENCE, 1) is None  # half a replica
    # One-device engines to a trainer of 2-device replicas: five devices drain four.
    g = make_graph(rollout=8, inference=2, actor=2, actor_unit=2, actor_sizes=(1, 3))
    assert _Sizes(g, {}, working={ROLLOUT})(ROLLOUT, ACTOR, 5) == (ROLLOUT, ACTOR, 4)
    # With valid sizes 1 and 2, four devices grow it by one replica and leave two,
    # left over by the size, not the unit: those go free as asked.
    g = make_graph(rollout=8, inference=2, actor=2, actor_unit=2, actor_sizes=(1, 2))
    assert _Sizes(g, {}, working={ROLLOUT})(ROLLOUT, ACTOR, 4) == (ROLLOUT, ACTOR, 4)
