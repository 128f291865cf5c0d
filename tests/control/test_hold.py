"""Holding the trainer at a step boundary while devices are on their way to it."""

import pytest

from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.controller import Controller
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.modes import make_hold
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.policies.hold import HoldForDevices, trainers_to_hold
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import finish_times
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT, TO_ACTOR, TO_INFERENCE
from dynarl.core.clock import ManualClock
from dynarl.core.ids import ComponentId, GroupId, InstanceId, ItemId, MigrationId

from .graphs import make_graph
from .test_controller_observe import DoNothing, NoMoves
from .test_policies import predictor_for


def fitted(graph: Hypergraph, *, inference_rate: float) -> Predictor:
    """Rollout and actor as :func:`predictor_for`; inference ``inference_rate``
    samples/s per device."""
    p = Predictor({c: n.spec.scaling for c, n in graph.components.items()})
    for n in (1, 2, 4, 8):
        p.observe(INFERENCE, n, 512, inference_rate * n)
        p.observe(ACTOR, n, 512, 10.0 * n)
    return p


def last_minibatch(*, at_inference: int) -> Hypergraph:
    """The actor on 2 of 8 devices with one minibatch ready (1000 samples) and the
    other (1000) still arriving: ``at_inference`` at the inference stage's 6 devices,
    the rest already here. Inference does 100 samples/s per device, the actor 10."""
    g = make_graph(rollout=0, inference=6, actor=2, actor_sizes=(1, 2, 4, 8), actor_steps=2)
    g.apply(ev.IterationStarted(iteration=0))
    here = 2000 - at_inference
    refs = tuple(ev.ItemRef(ItemId(f"a{k}"), GroupId(f"g{k}")) for k in range(here))
    g.apply(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
    refs = tuple(ev.ItemRef(ItemId(f"i{k}"), GroupId(f"h{k}")) for k in range(at_inference))
    g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs))
    replicas = sorted(g.components[INFERENCE].active_instances(), key=lambda n: n.id)
    for k, ref in enumerate(refs):
        g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=ref.id, instance=replicas[k % 6].id))
    return g


def _move_a_replica_to_rollout(g: Hypergraph) -> None:
    """Start moving the first inference replica's devices to a new rollout engine."""
    replica = min(g.components[INFERENCE].active_instances(), key=lambda n: n.id)
    move = Migration(
        id=MigrationId(0),
        kind="workload",
        src=INFERENCE,
        dst=ROLLOUT,
        devices=replica.devices,
        drain=(replica.id,),
        create=(InstanceSpec(id=InstanceId("rollout-0"), devices=replica.devices),),
    )
    g.apply(ev.MigrationStarted(migration=move))


def test_the_next_step_waits_when_the_freed_devices_finish_it_sooner() -> None:
    # 60 samples left at inference: 0.1 s there, then a reshard (1.5 s) and the step on
    # 8 devices (12.5 s) beats the step on 2 (50 s) started now.
    g = last_minibatch(at_inference=60)
    p = predictor_for(g)
    assert trainers_to_hold(g, p) == {ACTOR}
    assert HoldForDevices(p).holds(g) == frozenset({ACTOR})
    # The model's finish counts the wait: both steps on 8 devices after the join.
    devices = {c: n.num_active_devices for c, n in g.components.items()}
    assert finish_times(g, p, devices)[ACTOR] < 30.0


def test_the_hold_is_decided_while_another_stage_moves_devices() -> None:
    # A step boundary can come while a move the trainer takes no part in is under
    # way (in simulated 32B math, rollout's last devices going to inference as the
    # trainer's step ended). The devices in transit count where they go: the freed
    # devices still finish the step sooner, so the trainer is held. (Keeping the hold
    # as it was while any move ran let a 16-device step start and the cluster wait
    # 800 s behind it.)
    g = last_minibatch(at_inference=60)
    _move_a_replica_to_rollout(g)
    assert not g.components[ComponentId(ACTOR)].hold_steps
    p = predictor_for(g)
    assert HoldForDevices(p).holds(g) == frozenset({ACTOR})


def test_no_hold_when_the_devices_come_too_late_or_never() -> None:
    # The second minibatch is still at inference: at 0.5 samples/s per device its
    # devices free in ~330 s, long after the first step on 2 devices (50 s) ends.
    slow = last_minibatch(at_inference=1000)
    assert trainers_to_hold(slow, fitted(slow, inference_rate=0.5)) == set()
    # At 100 samples/s per device they free in under 2 s: worth waiting for.
    assert trainers_to_hold(slow, fitted(slow, inference_rate=100.0)) == {ACTOR}
    # Nothing upstream: no device is on its way, whatever the trainer holds.
    done = last_minibatch(at_inference=0)
    assert trainers_to_hold(done, predictor_for(done)) == set()


def test_the_controller_marks_and_lifts_the_hold() -> None:
    g = last_minibatch(at_inference=60)
    cfg = SchedulerConfig()
    hold = make_hold(cfg, predictor_for(g))
    assert hold is not None
    assert make_hold(SchedulerConfig(mode="static-colocated"), predictor_for(g)) is None
    assert make_hold(SchedulerConfig(hold_trainer=False), predictor_for(g)) is None
    controller = Controller(g, DoNothing(), NoMoves(), clock=ManualClock(), hold=hold)
    assert not g.components[ComponentId(ACTOR)].hold_steps
    controller.decide(Trigger(kind="tick", time_s=0.0))
    assert g.components[ComponentId(ACTOR)].hold_steps
    # Inference finishes: nothing is left upstream, so the hold lifts.
    for node in list(g.components[INFERENCE].active_instances()):
        for item in list(node.items):
            sample = (ev.ItemRef(item, GroupId("x")),)
            controller.handle(ev.ItemsEnqueued(edge=TO_ACTOR, items=sample))
            controller.handle(ev.ItemCompleted(edge=TO_INFERENCE, item=item, instance=node.id))
    controller.decide(Trigger(kind="tick", time_s=1.0))
    assert not g.components[ComponentId(ACTOR)].hold_steps


def test_a_step_in_progress_ends_its_length_after_it_began_not_from_now() -> None:
    # The first step (1000 samples, 50 s on 2 devices) began at t=0; the second
    # minibatch's last 60 samples leave inference at 20 s. At t=40 the first step ends
    # in 10 s, before the devices come: the second should wait for them (on 8
    # devices at ~21.5 s it ends at ~34 s, not at 60 s on 2). Counting the running
    # step from now (ending at 90 s), the devices looked as if they came in time.
    g = last_minibatch(at_inference=60)
    trainers = sorted(g.components[ACTOR].active_instances(), key=lambda n: n.id)
    for k in range(1000):
        g.apply(
            ev.ItemRouted(
                edge=TO_ACTOR, item=ItemId(f"a{k}"), instance=trainers[k % 2].id, time_s=0.0
            )
        )
    p = fitted(g, inference_rate=0.5)
    g.apply(ev.WorkerIdle(instance=trainers[0].id, time_s=40.0))  # the clock moves on
    assert trainers_to_hold(g, p) == {ACTOR}


def test_a_move_under_way_holds_the_trainer_for_the_devices_left_idle() -> None:
    # Inference has finished (nothing upstream), its 6 devices idle, while a move of
    # one replica to rollout is under way: the scheduler plans nothing until it lands,
    # so a step started now on the actor's 2 devices (50 s) would keep the idle ones
    # waiting at its boundary (in simulated agentic 7B on 128 devices, a 151 s step on
    # 4 devices while 120 waited). Holding for them (the move's cost, a reshard, then
    # the step on 6) is sooner. Once the move lands, the hold lifts by itself.
    g = last_minibatch(at_inference=0)
    p = predictor_for(g)
    assert trainers_to_hold(g, p) == set()
    _move_a_replica_to_rollout(g)
    assert trainers_to_hold(g, p) == {ACTOR}
    g.apply(ev.MigrationDone(migration=MigrationId(0), duration_s=1.0))
    assert trainers_to_hold(g, p) == set()


def test_devices_flow_to_the_trainer_only_after_the_plans_migrations_end() -> None:
    # No plan commits while one is in flight, so the devices the stages before the
    # trainer free move on only once the plan's own migrations are done. A plan whose
    # move takes 20 s (a new inference replica booting) must not be scored as if
    # inference's devices joined the trainer 0.1 s + a reshard from now. (In a
    # simulated run, moving idle rollout engines to inference at the rollout's end
    # kept the trainer waiting 3.5 s for devices the score had it use at once.)
    g = last_minibatch(at_inference=60)
    p = predictor_for(g)
    devices = {c: n.num_active_devices for c, n in g.components.items()}
    now = finish_times(g, p, devices)[ACTOR]
    later = finish_times(g, p, devices, delays={ComponentId(INFERENCE): 20.0})[ACTOR]
    reshard = p.migration_cost("reshard")
    assert now == pytest.approx(0.1 + reshard + 2 * 12.5, rel=0.05)
    assert later == pytest.approx(20.0 + reshard + 2 * 12.5, rel=0.05)
