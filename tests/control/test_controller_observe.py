"""What the controller teaches the predictor about a stage: its capacity per occupied
instance-second (the time its instances held items), not its completion rate, which
falls to its inputs' arrival rate whenever the stage waits for them."""

import pytest

from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, InstanceSpec, Migration, Plan
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import PrefillCost, Profile
from dynarl.control.scheduler import Trigger
from dynarl.control.topology import INFERENCE, PROMPTS, ROLLOUT, TO_INFERENCE, rl_pipeline
from dynarl.core.clock import ManualClock
from dynarl.core.ids import DeviceId, EdgeId, GroupId, InstanceId, ItemId, MigrationId

from .graphs import make_graph

SERVICE_S = 0.1  # an inference replica finishes a sample 0.1 s after it gets it
GAP_S = 1.0  # then waits this long for the next one


class DoNothing:
    name = "do-nothing"

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        return EMPTY_PLAN


class NoMoves:
    async def execute(self, migration: Migration) -> None:
        raise AssertionError("no migration expected")


def observing_controller(g: Hypergraph) -> tuple[Controller, ManualClock, Predictor]:
    predictor = Predictor({c: n.spec.scaling for c, n in g.components.items()})
    clock = ManualClock()
    controller = Controller(g, DoNothing(), NoMoves(), clock=clock, predictor=predictor)
    return controller, clock, predictor


def starved_cycles(controller: Controller, clock: ManualClock, start: int, count: int) -> None:
    """Each cycle one sample arrives per replica (the tick sees it queued), is routed,
    completes ``SERVICE_S`` later, and the replicas then wait ``GAP_S`` for the next."""
    replicas = sorted(controller.graph.components[INFERENCE].active_instances(), key=lambda n: n.id)
    for k in range(start, start + count):
        items = [ItemId(f"s{k}-{r}") for r in range(len(replicas))]
        refs = tuple(ev.ItemRef(i, GroupId(f"g{k}")) for i in items)
        controller.handle(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs))
        controller._observe_tick(clock.now())
        for item, node in zip(items, replicas, strict=True):
            controller.handle(ev.ItemRouted(edge=TO_INFERENCE, item=item, instance=node.id))
        clock.advance(SERVICE_S)
        for item, node in zip(items, replicas, strict=True):
            controller.handle(ev.ItemCompleted(edge=TO_INFERENCE, item=item, instance=node.id))
        clock.advance(GAP_S)


def test_a_starved_stage_is_observed_at_its_service_rate_not_its_arrival_rate() -> None:
    g = make_graph(rollout=2, inference=2, actor=2)
    controller, clock, predictor = observing_controller(g)
    tau = g.components[INFERENCE].work_rate.tau_s
    # Two replicas hold items 0.1 s per cycle: they must hold them tau seconds each
    # (2 * tau instance-seconds) before the first observation.
    before = int(2 * tau / (2 * SERVICE_S)) - 2
    starved_cycles(controller, clock, 0, before)
    assert predictor.predict(INFERENCE, 2, 2).num_observations == 0
    starved_cycles(controller, clock, before, 5 * before)
    estimate = predictor.predict(INFERENCE, 2, 2)
    assert estimate.num_observations >= 3
    # 10 samples/s per replica while it works (the arrival rate is ~0.9/s).
    assert estimate.throughput / 2 == pytest.approx(1 / SERVICE_S, rel=0.05)


def test_a_change_of_devices_restarts_the_occupancy_window() -> None:
    g = make_graph(rollout=2, inference=2, actor=2, free=1)
    controller, clock, predictor = observing_controller(g)
    tau = g.components[INFERENCE].work_rate.tau_s
    cycles = int(2 * tau / (2 * SERVICE_S))
    starved_cycles(controller, clock, 0, cycles + 2)
    seen = predictor.predict(INFERENCE, 2, 2).num_observations
    assert seen == 1
    # A third replica joins: what the two did says nothing about three.
    move = Migration(
        id=MigrationId(0),
        kind="workload",
        src=None,
        dst=INFERENCE,
        devices=(DeviceId(g.num_devices - 1),),
        create=(
            InstanceSpec(id=g.new_instance_id(INFERENCE), devices=(DeviceId(g.num_devices - 1),)),
        ),
    )
    g.apply(ev.MigrationStarted(migration=move, time_s=clock.now()))
    g.apply(ev.MigrationDone(migration=move.id, time_s=clock.now()))
    assert g.components[INFERENCE].num_active_devices == 3
    # Three replicas need 3 * tau instance-seconds at 0.3 per cycle: none before that.
    starved_cycles(controller, clock, 1000, cycles - 1)
    assert predictor.predict(INFERENCE, 3, 3).num_observations == seen
    starved_cycles(controller, clock, 2000, 3 * cycles)
    estimate = predictor.predict(INFERENCE, 3, 3)
    assert estimate.num_observations >= seen + 2
    assert estimate.throughput / 3 == pytest.approx(1 / SERVICE_S, rel=0.05)


def enqueue(g: Hypergraph, edge: EdgeId, names: list[str], t: float) -> list[ItemId]:
    items = [ItemId(n) for n in names]
    refs = tuple(ev.ItemRef(i, GroupId(i)) for i in items)
    g.apply(ev.ItemsEnqueued(edge=edge, items=refs, time_s=t))
    return items


def test_occupied_spans_open_on_the_first_item_and_close_when_the_last_leaves() -> None:
    g = make_graph(rollout=2, inference=2, actor=2)
    inf = g.components[INFERENCE]
    i0, i1 = InstanceId("inference-0"), InstanceId("inference-1")
    a, b, c, d = enqueue(g, TO_INFERENCE, ["a", "b", "c", "d"], 0.0)
    assert inf.occupied_until(5.0) == 0.0  # queued items occupy nobody

    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=a, instance=i0, time_s=1.0))
    assert g.instances[i0].held_since_s == 1.0
    assert inf.occupied_until(3.0) == pytest.approx(2.0)  # an open span counts so far
    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=b, instance=i0, time_s=2.0))
    assert g.instances[i0].held_since_s == 1.0  # already open: a second item adds no time
    g.apply(ev.ItemCompleted(edge=TO_INFERENCE, item=a, instance=i0, time_s=3.0))
    assert g.instances[i0].held_since_s == 1.0  # b is still held
    assert inf.occupied_s == 0.0
    # Requeued: i0 holds nothing from t=4.
    g.apply(ev.ItemsRequeued(edge=TO_INFERENCE, items=(b,), time_s=4.0))
    assert g.instances[i0].held_since_s is None
    assert inf.occupied_s == pytest.approx(3.0)
    assert inf.occupied_until(100.0) == pytest.approx(3.0)  # idle time adds nothing

    # Completed: i1 holds b from 5 to 6.
    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=b, instance=i1, time_s=5.0))
    g.apply(ev.ItemCompleted(edge=TO_INFERENCE, item=b, instance=i1, time_s=6.0))
    assert g.instances[i1].held_since_s is None
    assert inf.occupied_s == pytest.approx(4.0)

    # Two replicas holding items at once count twice.
    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=c, instance=i0, time_s=7.0))
    g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=d, instance=i1, time_s=7.5))
    assert inf.occupied_until(8.0) == pytest.approx(4.0 + 1.0 + 0.5)

    # Removed (a failed worker): its items go back to the queue, its span closes.
    g.apply(ev.WorkerFailed(instance=i0, reason="crash", time_s=9.0))
    assert inf.occupied_s == pytest.approx(4.0 + 2.0)
    assert inf.occupied_until(9.0) == pytest.approx(4.0 + 2.0 + 1.5)

    # Removed by a migration that drained it: the span closes when the move ends.
    move = Migration(
        id=MigrationId(0),
        kind="workload",
        src=INFERENCE,
        dst=None,
        devices=g.instances[i1].devices,
        drain=(i1,),
    )
    g.apply(ev.MigrationStarted(migration=move, time_s=10.0))
    assert inf.occupied_until(10.5) == pytest.approx(6.0 + 3.0)  # draining still holds d
    g.apply(ev.MigrationDone(migration=move.id, time_s=11.0))
    assert inf.occupied_s == pytest.approx(6.0 + 3.5)
    assert inf.occupied_until(50.0) == pytest.approx(9.5)
    assert g.queue_depth(INFERENCE) == 2  # c and d wait again
    g.check()


def test_a_tool_call_closes_an_engines_occupied_span() -> None:
    g = make_graph(rollout=2, inference=2, actor=2)
    rollout = g.components[ROLLOUT]
    e0 = InstanceId("rollout-0")
    (p,) = enqueue(g, PROMPTS, ["p"], 0.0)
    g.apply(ev.ItemRouted(edge=PROMPTS, item=p, instance=e0, time_s=1.0))
    g.apply(ev.ToolCallStarted(edge=PROMPTS, item=p, instance=e0, time_s=3.0))
    assert g.instances[e0].held_since_s is None
    assert rollout.occupied_until(10.0) == pytest.approx(2.0)  # time in the tool is not held
    g.apply(ev.ToolCallFinished(edge=PROMPTS, item=p, time_s=6.0))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=p, instance=e0, time_s=7.0))
    assert rollout.occupied_until(8.0) == pytest.approx(3.0)
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=p, instance=e0, time_s=9.0))
    assert rollout.occupied_s == pytest.approx(4.0)
    g.check()


def rollout_graph(max_running: int) -> Hypergraph:
    spec = rl_pipeline(
        rollout_tp=1,
        inference_tp=1,
        actor_devices_per_replica=1,
        actor_dp_sizes=(1,),
        rollout_max_running=max_running,
    )
    placement = {
        ROLLOUT: [
            InstanceSpec(id=InstanceId(f"rollout-{i}"), devices=(DeviceId(i),)) for i in range(2)
        ]
    }
    return Hypergraph(spec, num_devices=2, placement=placement)


def report(controller: Controller, running: int, context: int = 1000) -> None:
    """Both engines report ``running`` requests holding ``context`` tokens each, at
    the rate a decode step of ``STEP_A + (STEP_B + STEP_C * context) * running``
    seconds gives."""
    step = STEP_A + (STEP_B + STEP_C * context) * running
    for i in range(2):
        controller.handle(
            ev.EngineStats(
                instance=InstanceId(f"rollout-{i}"),
                kv_usage=min(1.0, running * context / 100_000),
                num_running=running,
                num_queued=0,
                gen_tokens_per_s=running / step,
                kv_tokens=running * context,
            )
        )


STEP_A, STEP_B, STEP_C = 0.02, 1e-4, 1e-7


def test_the_rollout_is_observed_at_its_context_so_the_tail_does_not_skew_the_bulk() -> None:
    # A full batch at short contexts, then the tail: few requests, long contexts. The
    # fit learns what a token of context costs; its prediction of the next full batch
    # stays right after the tail (a model without context read the tail as a large
    # per-request cost and predicted the next rollout several times too slow).
    g = rollout_graph(max_running=64)
    controller, clock, predictor = observing_controller(g)
    clock.advance(1.0)
    report(controller, 64, 500)  # its first window: the meter starts
    tau = g.components[ROLLOUT].work_rate.tau_s
    for running, context in [(64, 500), (64, 1000), (48, 2000), (32, 4000)] + [
        (n, 8000 + 1000 * n) for n in (16, 8, 4, 2, 1, 1, 1, 1)
    ]:
        clock.advance(tau)
        report(controller, running, context)
        controller._observe_tick(clock.now())
    costs = predictor.step_costs(ROLLOUT)
    assert costs is not None
    assert costs.a == pytest.approx(STEP_A, rel=0.02)
    assert costs.per_token(1000) == pytest.approx(STEP_B + STEP_C * 1000, rel=0.05)
    truth = 128 / (STEP_A + (STEP_B + STEP_C * 500) * 64)
    assert predictor.predict(ROLLOUT, 2, 128, context=500).throughput == pytest.approx(
        truth, rel=0.02
    )


def test_a_resized_rollout_is_observed_again_only_after_the_meters_time_constant() -> None:
    # Just resized, its engines re-prefill the requests moved to them: a slow window
    # the fit would read as a large per-request cost.
    g = rollout_graph(max_running=8)
    controller, clock, predictor = observing_controller(g)
    tau = g.components[ROLLOUT].work_rate.tau_s
    clock.advance(1.0)
    report(controller, 8)  # its first window since it started (or was resized)
    clock.advance(tau / 2)
    report(controller, 8)
    controller._observe_tick(clock.now())
    assert predictor.predict(ROLLOUT, 2, 16).num_observations == 0
    clock.advance(tau / 2)
    report(controller, 8)
    controller._observe_tick(clock.now())
    assert predictor.predict(ROLLOUT, 2, 16).num_observations == 1


def drain_rollout_0(moved: tuple[tuple[ItemId, InstanceId], ...]) -> Migration:
    """A workload migration that drains rollout-0, sending its requests as ``moved``
    says."""
    return Migration(
        id=MigrationId(0),
        kind="workload",
        src=ROLLOUT,
        dst=None,
        devices=(DeviceId(0),),
        drain=(InstanceId("rollout-0"),),
        reassign=moved,
    )


def test_a_rollout_is_not_observed_while_its_engines_re_prefill_moved_requests() -> None:
    # A migration moves an engine's requests to another, which re-prefills them one
    # after another, its running requests stalled meanwhile. Rates seen then are the
    # stall: the controller waits the re-prefill out (by the profile's prefill cost)
    # and the meter's time constant after it, however long ago the move started.
    # (On simulated math 7B, 199 long requests moved to 8 engines stalled them ~15 s;
    # observed, they drove the fitted fixed step cost to 0 and the predicted rollout
    # end 270 s late.)
    g = rollout_graph(max_running=8)
    cost = PrefillCost(s_per_token=1e-3, s_per_token_context=0.0, kv_capacity_tokens=1e6)
    predictor = Predictor(
        {c: n.spec.scaling for c, n in g.components.items()},
        profile=Profile(prefill={ROLLOUT: cost}),
    )
    clock = ManualClock()
    controller = Controller(g, DoNothing(), NoMoves(), clock=clock, predictor=predictor)
    refs = tuple(ev.ItemRef(ItemId(f"r{k}"), GroupId("g"), 1000) for k in range(8))
    controller.handle(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for k, ref in enumerate(refs):
        controller.handle(
            ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=InstanceId(f"rollout-{k % 2}"))
        )
    tau = g.components[ROLLOUT].work_rate.tau_s

    def observed_after(seconds: float) -> int:
        clock.advance(seconds)
        report(controller, 4)
        controller._observe_tick(clock.now())
        return predictor.predict(ROLLOUT, 2, 8).num_observations

    clock.advance(1.0)
    report(controller, 4)  # its first window: the meter starts
    assert observed_after(tau) == 1
    # rollout-0's four requests (their 1,000-token prompts and what they generated:
    # a millisecond a token) go to rollout-1, which re-prefills them in turn.
    moved = tuple((ref.id, InstanceId("rollout-1")) for ref in refs[0::2])
    source = g.instances[InstanceId("rollout-0")]
    contexts = [source.context_of(g.edges[PROMPTS].items[item]) for item, _ in moved]
    assert all(c > 1000 for c in contexts)
    span = 1e-3 * sum(contexts)
    controller._note_reprefill(drain_rollout_0(moved))
    assert observed_after(tau) == 1
    assert observed_after(span - 0.1) == 1
    assert observed_after(0.2) == 2
