"""Placement's routing rules beyond the policy: an instance with room takes the items
waiting at another (a busy one only those whose KV prefix that instance does not
hold), and a migration's plan says where a drained instance's items go."""

import itertools

from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.clock import ManualClock
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.peers import WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import FifoOrder
from dynarl.data.request_queue import RequestQueue
from dynarl.data.routing import AffinityRouting
from dynarl.data.transport import PeerId

from .helpers import item


def _worker(name: str, capacity: int) -> WorkerState:
    return WorkerState(
        PeerId(name.encode()),
        instance=InstanceId(name),
        component=ROLLOUT,
        capacity=capacity,
        queue=RequestQueue[wire.Item](FifoOrder(), max_size=100, clock=ManualClock()),
        now_s=0.0,
        sticky_max_queued=64,
        kv_full=0.95,
    )


def _start(w: WorkerState) -> None:
    """What the router's pump does: move queued items in flight, up to capacity."""
    for it in w.queue.get_batch_nowait(w.capacity - len(w.in_flight)):
        w.in_flight[it.id] = it


def _placement(events: list[ev.Event]) -> Placement:
    return Placement({PROMPTS: (ROLLOUT,)}, policy=AffinityRouting(seed=0), emit=events.append)


def _moves(events: list[ev.Event]) -> list[tuple[ItemId, InstanceId]]:
    """(item, instance) of each routing that followed a single-item requeue (a steal)."""
    out = []
    for before, after in itertools.pairwise(events):
        if isinstance(before, ev.ItemsRequeued) and isinstance(after, ev.ItemRouted):
            out.append((after.item, after.instance))
    return out


async def test_a_joining_instance_takes_the_oldest_items_waiting_elsewhere() -> None:
    events: list[ev.Event] = []
    p = _placement(events)
    a = _worker("a", capacity=2)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(6)], 0.0)
    _start(a)  # i0, i1 run; i2..i5 wait
    b = _worker("b", capacity=3)
    p.add_worker(b, 1.0)
    assert _moves(events) == [(ItemId(f"i{k}"), InstanceId("b")) for k in (2, 3, 4)]
    assert p.num_stolen == 3 and a.num_waiting == 1 and not b.can_start_now


async def test_a_busy_instance_takes_only_items_whose_prefix_the_other_does_not_hold() -> None:
    """A session back from a tool at ``a`` (its KV prefix there) waits for ``a``
    rather than stall ``b``'s batch with a re-prefill; a fresh request moves."""
    events: list[ev.Event] = []
    p = _placement(events)
    a, b = _worker("a", capacity=1), _worker("b", capacity=2)
    p.add_worker(a, 0.0)
    p.admit([item(0)], 0.0)
    _start(a)
    p.add_worker(b, 0.0)
    p.admit([item(1, affinity="prefer", instance=InstanceId("b"))], 0.0)
    _start(b)  # b is busy with i1, one slot free
    session = item(2, affinity="prefer", instance=InstanceId("a"), prefix_tokens=500)
    a.queue.put_nowait(session, now_s=1.0)  # as if it came back from its tool to a
    a.queue.put_nowait(item(3), now_s=2.0)
    p.steal_for(b, 3.0)
    assert _moves(events) == [(ItemId("i3"), InstanceId("b"))]
    # Once b is idle, the session is worth its re-prefill there.
    b.in_flight.clear()
    b.queue.take_all()
    p.steal_for(b, 4.0)
    assert _moves(events)[-1] == (ItemId("i2"), InstanceId("b"))


async def test_a_drained_instances_items_go_where_the_plan_says() -> None:
    events: list[ev.Event] = []
    p = _placement(events)
    a, b, c = _worker("a", 10), _worker("b", 10), _worker("c", 10)
    for w in (a, b, c):
        p.add_worker(w, 0.0)
    p.admit([item(k) for k in range(30)], 0.0)
    on_a = [it.id for it in a.queue.queued()]
    assert len(on_a) >= 3
    plan = {on_a[0]: InstanceId("c"), on_a[1]: InstanceId("b"), on_a[2]: InstanceId("c")}
    p.plan(plan.items())
    p.set_active(a, False, 1.0)
    routed = {e.item: e.instance for e in events[-len(on_a) :] if isinstance(e, ev.ItemRouted)}
    assert {i: routed[i] for i in plan} == plan
    assert set(routed) == set(on_a) and not p.planned
