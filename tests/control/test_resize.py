"""Engines regrouped into a wider size for the rollout's tail: the hypergraph's resize,
the planner's regroup, the predictor's fit per size and the policy that decides."""

import pytest

from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.modes import make_policy
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.resize import ResizeEngines, tail_unit
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import PrefillCost, Profile, ProfileRow
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT
from dynarl.core.errors import EventError
from dynarl.core.ids import DeviceId, GroupId, InstanceId, ItemId, MigrationId

from .graphs import carry_out, make_graph
from .test_policies import tick


def tail_graph(loads: list[int], *, tail_tp: int = 2) -> Hypergraph:
    """Rollout engines of one device (a tail size of ``tail_tp``) holding ``loads[k]``
    running requests each, every request 2,000 tokens into its response."""
    g = make_graph(rollout=len(loads), inference=2, actor=2, rollout_tail_tp=tail_tp)
    g.apply(ev.IterationStarted(iteration=0))
    for k, n in enumerate(loads):
        iid = InstanceId(f"rollout-{k}")
        refs = tuple(ev.ItemRef(ItemId(f"r{k}-{j}"), GroupId(f"g{k}-{j}")) for j in range(n))
        g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
        for ref in refs:
            g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=iid))
        g.apply(
            ev.EngineStats(
                instance=iid,
                kv_usage=0.1,
                num_running=n,
                num_queued=0,
                kv_tokens=2000 * n,
            )
        )
    return g


def decode_rate(devices: int, load: float, step_s: float) -> float:
    """Tokens/s of engines of one size, ``step_s`` a step plus 0.5 ms per request per
    device (``load`` running requests over ``devices`` devices)."""
    return load / (step_s + 0.0005 * load / devices)


def predictor(graph: Hypergraph, *, narrow_step_s: float, wide_step_s: float) -> Predictor:
    """A predictor whose profile measured the rollout's engines at their own size
    (one device) and at the tail's (two): steps of ``narrow_step_s`` and
    ``wide_step_s``; inference and the actor at fixed rates per device."""
    rows = []
    for n in (2, 4, 8):
        for load in (1, 8, 64):
            rows.append(
                ProfileRow(
                    component=ROLLOUT,
                    devices=n,
                    load=load,
                    throughput=decode_rate(n, load, narrow_step_s),
                )
            )
            rows.append(
                ProfileRow(
                    component=ROLLOUT,
                    devices=n,
                    load=load,
                    throughput=decode_rate(n, load, wide_step_s),
                    engine_devices=2,
                )
            )
        rows.append(ProfileRow(component=INFERENCE, devices=n, load=512, throughput=100.0 * n))
        rows.append(ProfileRow(component=ACTOR, devices=n, load=512, throughput=10.0 * n))
    prefill = {
        ROLLOUT: PrefillCost(s_per_token=1e-5, s_per_token_context=0.0, kv_capacity_tokens=1e6)
    }
    profile = Profile(rows=tuple(rows), prefill=prefill)
    return Predictor.for_pipeline(graph.spec, profile=profile)


def test_a_regroup_drains_every_engine_and_restarts_their_devices_wide() -> None:
    g = tail_graph([3, 3, 2, 2, 1, 1, 1])  # seven engines: the seventh has no partner
    items = {i for n in g.components[ROLLOUT].instances.values() for i in n.items}
    builder = PlanBuilder(g, reassign=False)
    m = builder.regroup(ROLLOUT, 2)
    assert m is not None and (m.src, m.dst, m.unit) == (ROLLOUT, ROLLOUT, 2)
    assert len(m.drain) == 7 and [len(s.devices) for s in m.create] == [2, 2, 2]
    carry_out(g, builder.build("regroup"))
    node = g.components[ROLLOUT]
    assert node.spec.devices_per_instance == 2 and node.num_active == 3
    assert all(len(n.devices) == 2 for n in node.active_instances())
    assert len(g.free_devices) == 1  # the seventh engine's device
    # Their requests wait for the wide engines, none lost.
    assert set(g.edges[PROMPTS].queue) == items
    # Instances of the component's own size are refused while it is wide.
    with pytest.raises(EventError, match="take 2"):
        g.apply(
            ev.MigrationStarted(
                migration=Migration(
                    id=MigrationId(g.next_migration_id),
                    kind="workload",
                    src=None,
                    dst=ROLLOUT,
                    devices=tuple(sorted(g.free_devices)),
                    create=(InstanceSpec(id=InstanceId("x"), devices=tuple(g.free_devices)),),
                )
            )
        )
    # Once every engine is gone (the iteration's end), the rollout is back at its size.
    to_actor = PlanBuilder(g)
    assert to_actor.move(ROLLOUT, ACTOR, drain=3) is not None
    carry_out(g, to_actor.build("the actor takes the cluster"))
    assert not node.instances and node.spec is node.base_spec


def test_a_resize_that_leaves_an_engine_or_takes_another_size_is_refused() -> None:
    g = tail_graph([2, 2, 2, 2])
    engines = sorted(g.components[ROLLOUT].active_instances(), key=lambda n: n.id)
    devices = tuple(d for n in engines for d in n.devices)

    def resize(unit: int, drained: int) -> Migration:
        return Migration(
            id=MigrationId(g.next_migration_id),
            kind="workload",
            src=ROLLOUT,
            dst=ROLLOUT,
            devices=tuple(d for n in engines[:drained] for d in n.devices),
            drain=tuple(n.id for n in engines[:drained]),
            create=(InstanceSpec(id=InstanceId("rollout-w"), devices=devices[:unit]),),
            unit=unit,
        )

    with pytest.raises(EventError, match="leaves"):
        g.apply(ev.MigrationStarted(migration=resize(2, 3)))
    with pytest.raises(EventError, match=r"take \(1, 2\)"):
        g.apply(ev.MigrationStarted(migration=resize(3, 4)))
    g.check()
    assert g.components[ROLLOUT].num_active == 4 and not g.migrations


def test_a_failed_regroup_puts_the_engines_back_at_their_size() -> None:
    g = tail_graph([2, 2, 2, 2])
    builder = PlanBuilder(g, reassign=False)
    m = builder.regroup(ROLLOUT, 2)
    assert m is not None
    g.apply(ev.MigrationStarted(migration=m))
    assert g.components[ROLLOUT].spec.devices_per_instance == 2
    g.apply(ev.MigrationFailed(migration=m.id, reason="engines would not start"))
    g.check()
    node = g.components[ROLLOUT]
    assert node.spec is node.base_spec and node.num_active == 4


def test_each_instance_size_has_its_own_fit() -> None:
    g = tail_graph([1, 1, 1, 1])
    p = predictor(g, narrow_step_s=0.02, wide_step_s=0.01)
    narrow, wide = p.step_costs(ROLLOUT), p.step_costs(ROLLOUT, 2)
    assert narrow is not None and wide is not None
    assert narrow.a == pytest.approx(0.02, rel=0.05) and wide.a == pytest.approx(0.01, rel=0.05)
    assert p.step_costs(ROLLOUT, 1) == narrow  # its own size is the plain fit
    # Observations of wide engines go to the wide fit only.
    for _ in range(50):
        p.observe(ROLLOUT, 8, 8, decode_rate(8, 8, 0.005), unit=2)
    assert p.step_costs(ROLLOUT) == narrow
    refitted = p.step_costs(ROLLOUT, 2)
    assert refitted is not None and refitted.a < 0.01
    # and the profile it hands on keeps them apart
    again = Predictor.for_pipeline(g.spec, profile=p.to_profile())
    assert again.step_costs(ROLLOUT) == pytest.approx(narrow)
    # A re-prefill is compute-bound: on engines twice as wide, half the time.
    own, twice = p.prefill_cost(ROLLOUT), p.prefill_cost(ROLLOUT, 2)
    assert own is not None and twice is not None
    assert twice.seconds(4000) == pytest.approx(own.seconds(4000) / 2)
    assert twice.kv_capacity_tokens == 2 * own.kv_capacity_tokens
    with pytest.raises(KeyError, match="no instances of 3 devices"):
        p.step_costs(ROLLOUT, 3)


def test_engines_regroup_when_the_wide_size_ends_the_tail_sooner() -> None:
    cfg = SchedulerConfig()
    g = tail_graph([2, 1, 1, 1, 1, 1, 1, 1])
    plan = ResizeEngines(cfg, predictor(g, narrow_step_s=0.02, wide_step_s=0.008)).decide(
        g, tick(5.0)
    )
    assert plan and plan.score_after < plan.score_before * (1 - cfg.min_gain)
    (m,) = plan.migrations
    assert m.unit == 2 and len(m.drain) == 8 and len(m.create) == 4
    assert "regroup 8 engines of 1 devices into 4 of 2" in plan.reason
    # A wide step barely cheaper does not pay for the move and the re-prefills.
    slow = predictor(g, narrow_step_s=0.02, wide_step_s=0.0198)
    assert not ResizeEngines(cfg, slow).decide(g, tick(5.0))


def test_no_regroup_while_sessions_are_in_a_tool_call_or_once_wide() -> None:
    g = tail_graph([2, 1, 1, 1, 1, 1, 1, 1])
    p = predictor(g, narrow_step_s=0.02, wide_step_s=0.008)
    g.apply(
        ev.ToolCallStarted(
            edge=PROMPTS, item=ItemId("r1-0"), instance=InstanceId("rollout-1"), prefix_tokens=9
        )
    )
    assert not ResizeEngines(SchedulerConfig(), p).decide(g, tick(5.0))
    wide = tail_graph([2, 1, 1, 1, 1, 1, 1, 1])
    builder = PlanBuilder(wide, reassign=False)
    builder.regroup(ROLLOUT, 2)
    carry_out(wide, builder.build("regroup"))
    assert not ResizeEngines(SchedulerConfig(), p).decide(wide, tick(6.0))
    # nor for a rollout with no tail size
    plain = tail_graph([2, 1, 1, 1, 1, 1, 1, 1], tail_tp=0)
    assert not ResizeEngines(SchedulerConfig(), predictor_plain(plain)).decide(plain, tick(5.0))


def predictor_plain(graph: Hypergraph) -> Predictor:
    rows = [
        ProfileRow(component=ROLLOUT, devices=n, load=load, throughput=decode_rate(n, load, 0.02))
        for n in (2, 4, 8)
        for load in (1, 8, 64)
    ]
    return Predictor.for_pipeline(graph.spec, profile=Profile(rows=tuple(rows)))


def test_a_device_list_of_the_wide_engines_is_their_drained_engines_devices() -> None:
    g = tail_graph([1, 1, 1, 1])
    engines = sorted(g.components[ROLLOUT].active_instances(), key=lambda n: min(n.devices))
    m = PlanBuilder(g, reassign=False).regroup(ROLLOUT, 2)
    assert m is not None
    expected = [tuple(DeviceId(d) for e in engines[i : i + 2] for d in e.devices) for i in (0, 2)]
    assert [s.devices for s in m.create] == expected


@pytest.mark.parametrize(
    ("actor", "rollout", "tp", "tail", "groups"),
    [
        # Engines on devices 1..5 (one actor device before them): the aligned pairs
        # (2, 3) and (4, 5), device 1 left over; in device order it would have been
        # (1, 2) and (3, 4), neither a group the real world built an engine on ahead.
        (1, 5, 1, 2, [(2, 3), (4, 5)]),
        # Engines of 2 on (2, 3), (4, 5), (6, 7), regrouped into 4: the aligned block
        # (4..7) of two whole engines; (2, 3) is too few for another.
        (2, 6, 2, 4, [(4, 5, 6, 7)]),
        # No aligned block they fill (engines of 2 on 1..6, into 4): in device order.
        (1, 6, 2, 4, [(1, 2, 3, 4)]),
        # Aligned blocks, then the rest in device order: as many as in device order.
        (1, 6, 1, 2, [(1, 6), (2, 3), (4, 5)]),
    ],
)
def test_a_regroup_takes_the_aligned_blocks_its_engines_fill_first(
    actor: int, rollout: int, tp: int, tail: int, groups: list[tuple[int, ...]]
) -> None:
    g = make_graph(actor=actor, rollout=rollout, inference=0, rollout_tp=tp, rollout_tail_tp=tail)
    m = PlanBuilder(g, reassign=False).regroup(ROLLOUT, tail)
    assert m is not None
    assert [s.devices for s in m.create] == [tuple(DeviceId(d) for d in g) for g in groups]


def test_waiting_requests_allow_a_regroup_until_the_rollout_has_seen_a_tool_call() -> None:
    """With requests waiting for a slot the predictor scores waves of full batches, a
    model of requests that hold their slot until they end: multi-turn sessions do not,
    so once a tool call has been seen, no regroup is scored while requests wait."""
    g = tail_graph([2, 1, 1, 1, 1, 1, 1, 1])
    g.apply(
        ev.ItemsEnqueued(
            edge=PROMPTS, items=tuple(ev.ItemRef(ItemId(f"w{j}"), GroupId("w")) for j in range(4))
        )
    )
    assert g.waiting_for_slot(ROLLOUT) == 4
    p = predictor(g, narrow_step_s=0.02, wide_step_s=0.008)
    assert ResizeEngines(SchedulerConfig(), p).decide(g, tick(5.0))
    g.components[ROLLOUT].tool_returns.append(1)  # a session came back from a tool
    assert not ResizeEngines(SchedulerConfig(), p).decide(g, tick(5.0))


def start_graph(*, prompts: int = 64) -> Hypergraph:
    """An iteration's start: the actor holds every device, the rollout none (its
    engines of one device may be two wide), ``prompts`` requests wait for it."""
    g = make_graph(rollout=0, inference=0, actor=8, rollout_tail_tp=2)
    g.apply(ev.IterationStarted(iteration=1))
    refs = tuple(ev.ItemRef(ItemId(f"p{j}"), GroupId(f"g{j // 8}")) for j in range(prompts))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    return g


def test_the_iteration_start_borrow_starts_the_engines_at_the_size_predicted_better() -> None:
    cfg = SchedulerConfig()
    baseline = {ROLLOUT: 4, INFERENCE: 2, ACTOR: 2}
    g = start_graph()
    fast_wide = make_policy(cfg, predictor(g, narrow_step_s=0.02, wide_step_s=0.005), baseline)
    plan = fast_wide.decide(g, tick(0.0, "iteration_start"))
    (m,) = plan.migrations
    assert (m.src, m.dst, m.unit) == (ACTOR, ROLLOUT, 2)
    assert [len(s.devices) for s in m.create] == [2, 2, 2, 2]
    assert "its engines at 2 devices" in plan.reason and plan.score_after < plan.score_before
    carry_out(g, plan)
    node = g.components[ROLLOUT]
    assert node.spec.devices_per_instance == 2 and node.num_active == 4
    # Wide steps dearer than narrow ones: the engines start at their own size.
    g = start_graph()
    slow_wide = make_policy(cfg, predictor(g, narrow_step_s=0.02, wide_step_s=0.03), baseline)
    (m,) = slow_wide.decide(g, tick(0.0, "iteration_start")).migrations
    assert m.unit == 0 and [len(s.devices) for s in m.create] == [1] * 8


def test_once_a_tool_call_was_seen_waiting_sessions_start_on_engines_of_their_own_size() -> None:
    g = start_graph()
    p = predictor(g, narrow_step_s=0.02, wide_step_s=0.005)
    assert tail_unit(g, ROLLOUT, p) == 2
    g.components[ROLLOUT].tool_returns.append(1)  # sessions came back from tools before
    assert tail_unit(g, ROLLOUT, p) == 0
    policy = make_policy(SchedulerConfig(), p, {ROLLOUT: 4, INFERENCE: 2, ACTOR: 2})
    (m,) = policy.decide(g, tick(0.0, "iteration_start")).migrations
    assert m.unit == 0 and len(m.create) == 8


def test_a_move_starts_instances_at_another_size_only_where_the_component_has_none() -> None:
    g = start_graph()
    builder = PlanBuilder(g)
    m = builder.move(ACTOR, ROLLOUT, drain=3, unit=2)
    assert m is not None and m.unit == 2 and [len(s.devices) for s in m.create] == [2]
    with pytest.raises(ValueError, match="has instances"):
        builder.move(ACTOR, ROLLOUT, drain=2, unit=2)  # this plan already made one
    # A failed move puts the rollout back at its own size; the actor keeps its devices.
    g.apply(ev.MigrationStarted(migration=m))
    assert g.components[ROLLOUT].spec.devices_per_instance == 2
    g.apply(ev.MigrationFailed(migration=m.id, reason="engines would not start"))
    g.check()
    node = g.components[ROLLOUT]
    assert node.spec is node.base_spec and g.components[ACTOR].num_active == 8
