"""The hypergraph applies events incrementally and keeps its invariants."""

import pytest

from dynarl.control import events as ev
from dynarl.control.elements import TOOL
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.topology import ACTOR, PROMPTS, ROLLOUT, TO_INFERENCE
from dynarl.core.errors import EventError, InvariantError
from dynarl.core.ids import DeviceId, GroupId, InstanceId, ItemId, MigrationId

from .graphs import make_graph


def refs(n: int, group_size: int = 2) -> tuple[ev.ItemRef, ...]:
    return tuple(ev.ItemRef(ItemId(f"i{k}"), GroupId(f"g{k // group_size}")) for k in range(n))


def test_items_flow_from_queue_to_instance_to_completion() -> None:
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(3)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-0")))
    edge = g.edges[PROMPTS]
    assert list(edge.queue) == ["i1", "i2"]
    assert g.instances[InstanceId("rollout-0")].items == {"i0": PROMPTS}
    g.apply(
        ev.ItemCompleted(
            edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-0"), num_tokens=7
        )
    )
    assert g.pending(ROLLOUT) == 2
    assert (edge.num_enqueued, edge.num_completed, edge.tokens_completed) == (3, 1, 7)
    g.check()


def test_contradictory_event_is_rejected_and_changes_nothing() -> None:
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(2)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-0")))
    before = (dict(g.edges[PROMPTS].queue), dict(g.instances[InstanceId("rollout-1")].items))
    with pytest.raises(EventError, match="holds it"):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1")))
    with pytest.raises(EventError, match="does not consume"):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i1"), instance=InstanceId("actor-0")))
    with pytest.raises(EventError, match="enqueued twice"):
        g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(1)))
    with pytest.raises(EventError, match="unknown instance"):
        g.apply(ev.WorkerIdle(instance=InstanceId("nope")))
    assert (
        dict(g.edges[PROMPTS].queue),
        dict(g.instances[InstanceId("rollout-1")].items),
    ) == before
    g.check()


def test_migration_moves_devices_and_requeues_what_drained_instances_held() -> None:
    g = make_graph(rollout=2, inference=1, actor=1)
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(2)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-0")))
    rollout0 = g.instances[InstanceId("rollout-0")].devices
    m = Migration(
        id=MigrationId(0),
        kind="reshard",
        src=ROLLOUT,
        dst=ACTOR,
        devices=rollout0,
        drain=(InstanceId("rollout-0"),),
        create=(InstanceSpec(id=InstanceId("actor-1"), devices=rollout0),),
    )
    g.apply(ev.MigrationStarted(migration=m))
    assert g.instances[InstanceId("rollout-0")].state == "draining"
    assert g.components[ROLLOUT].num_active == 1
    # The data plane routes to it before it hears of the drain: the item is there
    # until the drain hands it back (here: until the migration ends).
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i1"), instance=InstanceId("rollout-0")))
    assert g.edges[PROMPTS].items[ItemId("i1")].owner == "rollout-0"
    g.check()
    g.apply(ev.MigrationDone(migration=MigrationId(0)))
    assert InstanceId("rollout-0") not in g.instances
    assert g.components[ACTOR].num_active_devices == 2
    assert set(g.edges[PROMPTS].queue) == {"i0", "i1"}  # nothing lost
    assert g.edges[PROMPTS].items[ItemId("i0")].last_instance == "rollout-0"
    g.check()


def test_failed_migration_leaves_the_old_placement_running() -> None:
    g = make_graph(rollout=2, inference=1, actor=1, free=1)
    devs = (*g.instances[InstanceId("rollout-1")].devices, DeviceId(4))
    m = Migration(
        id=MigrationId(3),
        kind="workload",
        src=ROLLOUT,
        dst=None,
        devices=devs,
        drain=(InstanceId("rollout-1"),),
    )
    g.apply(ev.MigrationStarted(migration=m))
    assert DeviceId(4) not in g.free_devices
    g.apply(ev.MigrationFailed(migration=MigrationId(3), reason="boom"))
    assert g.instances[InstanceId("rollout-1")].state == "active"
    assert g.components[ROLLOUT].num_active == 2
    assert DeviceId(4) in g.free_devices
    assert g.next_migration_id == 4
    g.check()


@pytest.mark.parametrize("outcome", ["failed", "done"])
def test_an_instance_that_crashes_while_its_migration_drains_it_leaves_its_devices_crashed(
    outcome: str,
) -> None:
    # Two rollout engines move to the actor; one dies as the move starts. Whether the
    # move then fails or completes without its device, the device is free and crashed
    # (the scheduler reboots it); the survivor's device is not.
    g = make_graph(rollout=2, inference=1, actor=1)
    r0, r1 = (g.instances[InstanceId(f"rollout-{k}")].devices for k in (0, 1))
    m = Migration(
        id=MigrationId(0),
        kind="reshard",
        src=ROLLOUT,
        dst=ACTOR,
        devices=(*r0, *r1),
        drain=(InstanceId("rollout-0"), InstanceId("rollout-1")),
        create=(InstanceSpec(id=InstanceId("actor-1"), devices=r1),),
    )
    g.apply(ev.MigrationStarted(migration=m))
    g.apply(ev.WorkerFailed(instance=InstanceId("rollout-0"), reason="killed"))
    assert not g.crashed_devices  # the migration holds the device meanwhile
    g.check()
    if outcome == "failed":
        g.apply(ev.MigrationFailed(migration=MigrationId(0), reason="rollout-0 is gone"))
        assert g.instances[InstanceId("rollout-1")].state == "active"
        assert set(r1).isdisjoint(g.free_devices)
    else:
        g.apply(ev.MigrationDone(migration=MigrationId(0)))
        assert InstanceId("actor-1") in g.instances
    assert g.crashed_devices == set(r0) <= g.free_devices
    assert not g.crashed_in_migration
    g.check()


def test_migration_cannot_take_busy_devices_or_drain_another_component() -> None:
    g = make_graph(rollout=2, inference=1, actor=1)
    actor_dev = g.instances[InstanceId("actor-0")].devices
    bad = Migration(id=MigrationId(0), kind="workload", src=ROLLOUT, dst=None, devices=actor_dev)
    with pytest.raises(EventError, match="not free"):
        g.apply(ev.MigrationStarted(migration=bad))
    wrong = Migration(
        id=MigrationId(0),
        kind="workload",
        src=ROLLOUT,
        dst=None,
        devices=actor_dev,
        drain=(InstanceId("actor-0"),),
    )
    with pytest.raises(EventError, match="not an active"):
        g.apply(ev.MigrationStarted(migration=wrong))
    g.check()


def test_worker_failure_requeues_items_and_marks_devices_crashed() -> None:
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(2)))
    for item in ("i0", "i1"):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId(item), instance=InstanceId("rollout-2")))
    devs = g.instances[InstanceId("rollout-2")].devices
    g.apply(ev.WorkerFailed(instance=InstanceId("rollout-2"), reason="killed"))
    assert set(g.edges[PROMPTS].queue) == {"i0", "i1"}
    assert set(devs) <= g.crashed_devices <= g.free_devices
    assert g.components[ROLLOUT].num_active == 3
    g.check()


def test_tool_call_takes_item_out_of_its_engine_and_back_to_the_queue() -> None:
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(1)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1")))
    g.apply(
        ev.ToolCallStarted(
            edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1"), prefix_tokens=120
        )
    )
    st = g.edges[PROMPTS].items[ItemId("i0")]
    assert st.owner == TOOL and g.edges[PROMPTS].num_in_tool == 1
    assert not g.instances[InstanceId("rollout-1")].items
    g.check()
    g.apply(ev.ToolCallFinished(edge=PROMPTS, item=ItemId("i0"), latency_s=0.3))
    assert st.owner is None and st.tool_calls == 1 and st.prefix_tokens == 120
    assert st.last_instance == "rollout-1"
    g.check()


def test_a_session_its_environment_ends_in_a_tool_call_completes_on_its_last_engine() -> None:
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs(1)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1")))
    g.apply(ev.ToolCallStarted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1")))
    with pytest.raises(EventError):  # not the engine that served it
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-0")))
    g.apply(
        ev.ItemCompleted(
            edge=PROMPTS, item=ItemId("i0"), instance=InstanceId("rollout-1"), num_tokens=40
        )
    )
    edge = g.edges[PROMPTS]
    assert not edge.items and edge.num_in_tool == 0 and edge.num_completed == 1
    assert g.components[ROLLOUT].tokens_completed_iter == 40
    g.check()


def test_engine_stats_track_time_below_u_low() -> None:
    g = make_graph(u_low=0.2)
    node = g.instances[InstanceId("rollout-0")]
    g.apply(ev.EngineStats(instance=node.id, kv_usage=0.5, num_running=4, num_queued=0, time_s=1.0))
    assert g.low_for(node, 5.0) == 0.0
    g.apply(ev.EngineStats(instance=node.id, kv_usage=0.1, num_running=1, num_queued=0, time_s=2.0))
    g.apply(
        ev.EngineStats(instance=node.id, kv_usage=0.05, num_running=1, num_queued=0, time_s=3.0)
    )
    assert g.low_for(node, 6.5) == pytest.approx(4.5)
    with pytest.raises(EventError, match="impossible"):
        g.apply(ev.EngineStats(instance=node.id, kv_usage=1.5, num_running=1, num_queued=0))
    # More seconds re-prefilling moved requests than prefilling at all: impossible.
    with pytest.raises(EventError, match="impossible"):
        g.apply(
            ev.EngineStats(
                instance=node.id,
                kv_usage=0.1,
                num_running=1,
                num_queued=0,
                prefill_s=1.0,
                resume_prefill_s=1.5,
            )
        )


def test_check_catches_a_corrupted_model() -> None:
    g = make_graph()
    g.free_devices.add(g.instances[InstanceId("rollout-0")].devices[0])
    with pytest.raises(InvariantError, match="device"):
        g.check()
    g = make_graph()
    g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs(1)))
    del g.edges[TO_INFERENCE].queue[ItemId("i0")]
    with pytest.raises(InvariantError, match="owned by nobody"):
        g.check()
