"""The event reporter owns the order of a real run's events: a completed item is
enqueued on its next edge before it completes, and never twice."""

from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, TO_ACTOR, TO_INFERENCE
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.rl.reporter import EventReporter

ITEM = ItemId("0-0-0")
GROUP = GroupId("0/0")
ENGINE = InstanceId("rollout-0")


def reporter(known: set[str] | None = None) -> tuple[EventReporter, list[ev.Event]]:
    seen: list[ev.Event] = []
    r = EventReporter(
        successors={PROMPTS: TO_INFERENCE, TO_INFERENCE: TO_ACTOR},
        known=lambda i: known is None or i in known,
        grows=frozenset({PROMPTS}),
    )
    r.connect(seen.append)
    return r, seen


def test_the_next_edge_hears_of_a_completed_item_before_its_completion() -> None:
    r, seen = reporter()
    r(ev.ItemsEnqueued(edge=PROMPTS, items=(ev.ItemRef(ITEM, GROUP, 7),)))
    r(ev.ItemRouted(edge=PROMPTS, item=ITEM, instance=ENGINE))
    r(ev.ItemCompleted(edge=PROMPTS, item=ITEM, instance=ENGINE, num_tokens=5))
    enqueued, completed = seen[-2:]
    assert isinstance(enqueued, ev.ItemsEnqueued) and enqueued.edge == TO_INFERENCE
    # A sample is its prompt plus its response.
    assert enqueued.items == (ev.ItemRef(ITEM, GROUP, 12),)
    assert isinstance(completed, ev.ItemCompleted) and completed.edge == PROMPTS


def test_the_routers_own_enqueue_of_an_announced_item_is_not_reported_twice() -> None:
    r, seen = reporter()
    r(ev.ItemsEnqueued(edge=PROMPTS, items=(ev.ItemRef(ITEM, GROUP, 7),)))
    r(ev.ItemCompleted(edge=PROMPTS, item=ITEM, instance=ENGINE, num_tokens=5))
    before = len(seen)
    other = ev.ItemRef(ItemId("0-0-1"), GROUP, 9)
    # The driver submits the sample (and one that was not announced) to inference.
    r(ev.ItemsEnqueued(edge=TO_INFERENCE, items=(ev.ItemRef(ITEM, GROUP, 12), other)))
    assert seen[before:] == [ev.ItemsEnqueued(edge=TO_INFERENCE, items=(other,))]
    # Its completion there announces it on the actor's edge, at the same size.
    r(ev.ItemCompleted(edge=TO_INFERENCE, item=ITEM, instance=InstanceId("inference-0")))
    assert seen[-2] == ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(ITEM, GROUP, 12),))


def test_a_sample_set_aside_leaves_the_next_edge_and_counts_afresh_when_it_comes_back() -> None:
    """A partial rollout's finished sample of a group the iteration does not train is
    announced on the inference edge, but does not go there in this iteration: it
    leaves it, and the next iteration's submission enqueues it again."""
    r, seen = reporter()
    r(ev.ItemsEnqueued(edge=PROMPTS, items=(ev.ItemRef(ITEM, GROUP, 7),)))
    r(ev.ItemCompleted(edge=PROMPTS, item=ITEM, instance=ENGINE, num_tokens=5))
    before = len(seen)
    r.set_aside(PROMPTS, [ITEM, ItemId("0-0-1")])  # the other was never announced
    assert seen[before:] == [ev.ItemsWithdrawn(edge=TO_INFERENCE, items=(ITEM,))]
    r.set_aside(PROMPTS, [ITEM])  # once
    r.forget()  # the next iteration
    r(ev.ItemsEnqueued(edge=TO_INFERENCE, items=(ev.ItemRef(ITEM, GROUP, 12),)))
    assert seen[-1] == ev.ItemsEnqueued(edge=TO_INFERENCE, items=(ev.ItemRef(ITEM, GROUP, 12),))
    assert len(seen) == before + 2


def test_an_item_leaving_the_pipeline_announces_nothing() -> None:
    r, seen = reporter()
    r(ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(ITEM, GROUP, 12),)))
    r(ev.ItemCompleted(edge=TO_ACTOR, item=ITEM, instance=InstanceId("actor-0")))
    assert [type(e) for e in seen] == [ev.ItemsEnqueued, ev.ItemCompleted]


def test_load_of_an_unknown_instance_and_events_while_disconnected_are_dropped() -> None:
    r, seen = reporter(known={"rollout-0"})
    stats = ev.EngineStats(instance=ENGINE, kv_usage=0.5, num_running=2, num_queued=0)
    r(stats)
    r(ev.EngineStats(instance=InstanceId("rollout-9"), kv_usage=0.5, num_running=2, num_queued=0))
    assert seen == [stats]
    # A trainer rank (a worker the model does not know) left with nothing: its
    # replica's other ranks may still work.
    idle = ev.WorkerIdle(instance=ENGINE)
    r(ev.WorkerIdle(instance=InstanceId("trainer-1")))
    r(idle)
    assert seen == [stats, idle]
    r.disconnect()
    r(stats)
    assert seen == [stats, idle]


def test_a_trained_sample_is_reported_on_the_replica_its_rank_serves() -> None:
    seen: list[ev.Event] = []
    replicas: dict[InstanceId, InstanceId] = {InstanceId("trainer-0"): InstanceId("actor-3")}
    r = EventReporter(
        successors={},
        known=lambda i: True,
        replicas={TO_ACTOR: replicas.get},
    )
    r.connect(seen.append)
    r(ev.ItemRouted(edge=TO_ACTOR, item=ITEM, instance=InstanceId("trainer-0")))
    replicas.clear()  # a resize after the step changes the map: the routing is kept
    r(ev.ItemCompleted(edge=TO_ACTOR, item=ITEM, instance=InstanceId("trainer-0")))
    assert [getattr(e, "instance", None) for e in seen] == ["actor-3", "actor-3"]
    # A worker that serves no replica now: nothing the model knows of.
    r(ev.ItemRouted(edge=TO_ACTOR, item=ItemId("x"), instance=InstanceId("trainer-1")))
    r(ev.ItemCompleted(edge=TO_ACTOR, item=ItemId("x"), instance=InstanceId("trainer-1")))
    assert len(seen) == 2
