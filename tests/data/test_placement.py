"""Placement's routing rules beyond the policy: an instance with room takes the items
waiting at another (a busy one only those whose KV prefix that instance does not
hold), and a migration's plan says where a drained instance's items go."""

import itertools

import pytest

from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.balance import Balancer
from dynarl.data.component_peers import ComponentPeers
from dynarl.data.in_flight import InFlight
from dynarl.data.peers import RouterConfig, WorkerState, with_balance
from dynarl.data.placement import Placement
from dynarl.data.routing import AffinityRouting

from .helpers import item, start, worker


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
    a = worker("a", capacity=2)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(6)], 0.0)
    start(a)  # i0, i1 run; i2..i5 wait
    b = worker("b", capacity=3)
    p.add_worker(b, 1.0)
    assert _moves(events) == [(ItemId(f"i{k}"), InstanceId("b")) for k in (2, 3, 4)]
    assert p.num_stolen == 3 and a.num_waiting == 1 and not b.can_start_now


async def test_an_engine_taking_more_than_it_runs_has_room_only_for_its_slots() -> None:
    """A rollout slot takes up to its capacity (its engine queues what it cannot run,
    so admissions batch) but runs only its engine's batch: routing and stealing count
    that batch as its room, so an engine whose queue holds requests it cannot start
    is not taken for one with a free slot. (Counting the capacity as room, a batch
    spread by routing alone left some engines queuing while others had free slots:
    simulated math 1.5B on 64 devices, colocated, 188.9 -> 215.9 s an iteration.)"""
    events: list[ev.Event] = []
    p = _placement(events)
    a = worker("a", capacity=8, slots=2)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(6)], 0.0)
    start(a)  # the pump fills its capacity: all six go to a; two run, four wait there
    assert len(a.in_flight) == 6 and a.num_waiting == 4 and not a.can_start_now
    assert a.load == 3.0  # per slot
    b = worker("b", capacity=8, slots=2)
    p.add_worker(b, 1.0)
    p.admit([item(k) for k in range(6, 8)], 1.0)
    # New work goes to the engine with free slots, though a has room in its capacity.
    assert [e.instance for e in events if isinstance(e, ev.ItemRouted)][-2:] == ["b", "b"]
    assert not b.can_start_now and b.num_waiting == 0
    assert worker("c", capacity=4, slots=9).slots == 4  # never more than it takes
    assert worker("d", capacity=4).slots == 4  # 0: it runs all it takes


async def test_a_busy_instance_takes_only_items_whose_prefix_the_other_does_not_hold() -> None:
    """A session back from a tool at ``a`` (its KV prefix there) waits for ``a``
    rather than stall ``b``'s batch with a re-prefill; a fresh request moves."""
    events: list[ev.Event] = []
    p = _placement(events)
    a, b = worker("a", capacity=1), worker("b", capacity=2)
    p.add_worker(a, 0.0)
    p.admit([item(0)], 0.0)
    start(a)
    p.add_worker(b, 0.0)
    p.admit([item(1, affinity="prefer", instance=InstanceId("b"))], 0.0)
    start(b)  # b is busy with i1, one slot free
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
    a, b, c = worker("a", 10), worker("b", 10), worker("c", 10)
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


class _Recalls:
    """The placement's ``recall``: records each request and hands the items back
    aborted, as a rollout worker does on ``Abort``."""

    def __init__(self) -> None:
        self.asked: list[tuple[InstanceId, tuple[ItemId, ...]]] = []
        self.placement: Placement | None = None

    def __call__(self, w: WorkerState, items: tuple[ItemId, ...], now: float) -> None:
        self.asked.append((w.instance, items))
        assert self.placement is not None
        for i in items:
            self.placement.on_result(
                w, wire.ItemResult(item=i, status="aborted", num_tokens=7), now
            )


def _balancing(
    events: list[ev.Event], *, on: bool = True, join: bool | None = None, idle: bool | None = None
) -> tuple[Placement, _Recalls]:
    recalls = _Recalls()
    p = Placement(
        {PROMPTS: (ROLLOUT,)},
        policy=AffinityRouting(seed=0),
        emit=events.append,
        balance_on_join=on if join is None else join,
        balance_below_share=on if idle is None else idle,
        recall=recalls,
    )
    recalls.placement = p
    return p, recalls


async def test_instances_joining_one_after_another_share_the_backlog_by_capacity() -> None:
    """The join race: the batch arrives before any engine; the first to join takes it
    all (it fits its capacity), so later ones would find nothing waiting beyond it."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events)
    p.admit([item(k) for k in range(12)], 0.0)
    a, b, c = worker("a", 8), worker("b", 8), worker("c", 16)
    p.add_worker(a, 1.0)
    start(a)  # i0..i7 run at a, i8..i11 wait there
    assert len(a.in_flight) == 8 and len(a.queue) == 4
    p.add_worker(b, 2.0)  # share 12 * 8/16 = 6: the 4 waiting are stolen, 2 recalled
    assert recalls.asked == [(InstanceId("a"), (ItemId("i7"), ItemId("i6")))]
    assert [it.id for it in b.queue.queued()] == [ItemId(f"i{k}") for k in (8, 9, 10, 11, 7, 6)]
    start(b)
    p.add_worker(c, 3.0)  # share 12 * 16/32 = 6, three from each
    assert recalls.asked[1:] == [
        (InstanceId("a"), (ItemId("i5"), ItemId("i3"), ItemId("i1"))),
        (InstanceId("b"), (ItemId("i6"), ItemId("i10"), ItemId("i8"))),
    ] or sorted(len(ids) for _, ids in recalls.asked[1:]) == [3, 3]
    assert (len(a.in_flight), len(b.in_flight), len(c.queue)) == (3, 3, 6)
    assert (
        (p.num_stolen, p.balancer.num_balanced) == (4, 2 + 6)
        and not p.balancer.recalled
        and not p.planned
    )
    # The hypergraph sees each move: requeued (with the partial output), then routed.
    requeued = [e for e in events if isinstance(e, ev.ItemsRequeued)]
    assert sum(len(e.items) for e in requeued) == 12
    assert {e.generated for e in requeued if e.items[0] in {ItemId("i6"), ItemId("i7")}} >= {(7,)}


async def test_a_recalled_item_counts_where_it_is_going_until_it_comes_back() -> None:
    """Two engines join while the first one's recalled items are still on their way
    back: the second's share counts them at the first joiner, not at their holder, and
    the first joiner pays its part of the share with one of them, sent on."""
    events: list[ev.Event] = []
    p = Placement(
        {PROMPTS: (ROLLOUT,)},
        policy=AffinityRouting(seed=0),
        emit=events.append,
        recall=lambda w, items, now: asked.append((w.instance, items)),
    )
    asked: list[tuple[InstanceId, tuple[ItemId, ...]]] = []
    a, b, c = worker("a", 9), worker("b", 9), worker("c", 9)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(9)], 0.0)
    start(a)
    p.add_worker(b, 1.0)
    p.add_worker(c, 1.0)  # nothing came back yet
    # 9 * 1/2 = 4 for b; then 3 each: c gets two more from a and one of b's four.
    assert [len(ids) for _, ids in asked] == [4, 2]
    assert not set(asked[0][1]) & set(asked[1][1])
    going = [dst for _, dst in p.balancer.recalled.values()]
    assert (going.count(InstanceId("b")), going.count(InstanceId("c"))) == (3, 3)
    assert all(src == InstanceId("a") for src, _ in p.balancer.recalled.values())
    # One finishes before its abort lands: it completes at a, and the plan is forgotten.
    done = asked[0][1][1]
    p.on_result(a, wire.ItemResult(item=done, num_tokens=3), 2.0)
    assert done not in p.balancer.recalled and done not in p.planned


async def test_without_balancing_a_joiner_takes_only_what_waits_beyond_capacity() -> None:
    events: list[ev.Event] = []
    p, recalls = _balancing(events, on=False)
    a, b = worker("a", 8), worker("b", 8)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(8)], 0.0)
    start(a)
    p.add_worker(b, 1.0)
    assert b.is_idle and not recalls.asked and p.balancer.num_balanced == 0


async def test_balancing_never_moves_an_item_that_must_return_to_its_instance() -> None:
    events: list[ev.Event] = []
    p, recalls = _balancing(events)
    a, b = worker("a", 8), worker("b", 8)
    p.add_worker(a, 0.0)
    p.admit([item(k, affinity="must", instance=InstanceId("a")) for k in range(6)], 0.0)
    p.admit([item(k) for k in range(6, 8)], 0.0)
    start(a)
    p.add_worker(b, 1.0)  # share 4, but only the two free items may move
    assert recalls.asked == [(InstanceId("a"), (ItemId("i7"), ItemId("i6")))]
    assert sorted(it.id for it in b.queue.queued()) == [ItemId("i6"), ItemId("i7")]


async def test_an_engine_below_its_share_takes_its_share_of_the_tail_each_request_moved_once() -> (
    None
):
    """The rollout tail: ``a`` decodes six long requests while ``b``, still busy with
    one of its two, is far below its share after a result: it takes two (the most
    recently dispatched). Short of its share by no more than the share's square root,
    it takes no running request (a re-prefill to chase the drift of random finishing
    order); left with nothing, two more; once ``a`` is done, it
    takes none back (each request is re-prefilled for balance at most once)."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events, join=False)
    a, b = worker("a", 8), worker("b", 8)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(6)], 0.0)
    start(a)
    p.add_worker(b, 1.0)  # no balance on joining here
    p.admit([item(6), item(7)], 1.0)  # both to b, the less loaded
    start(b)
    assert recalls.asked == [] and len(b.in_flight) == 2
    p.on_result(b, wire.ItemResult(item=ItemId("i6"), num_tokens=5), 2.0)
    p.after_results(b, 2.0)  # holds 1 of 7: its share is 7 * 8/16 = 3, 2 short
    assert recalls.asked == [(InstanceId("a"), (ItemId("i5"), ItemId("i4")))]
    start(b)
    for t, k in ((3.0, 7), (3.5, 5)):
        p.on_result(b, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), t)
        p.after_results(b, t)  # holds 2 of 6 (share 3), then 1 of 5 (share 2): 1 short
    assert len(recalls.asked) == 1 and len(b.in_flight) == 1
    p.on_result(b, wire.ItemResult(item=ItemId("i4"), num_tokens=5), 4.0)
    p.after_results(b, 4.0)  # holds none of 4: 2 short of its share of 2
    assert recalls.asked[1:] == [(InstanceId("a"), (ItemId("i3"), ItemId("i2")))]
    start(b)
    for k in (0, 1):
        p.on_result(a, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), 5.0)
    p.after_results(a, 5.0)  # below its share, but b's two were moved once already
    assert len(recalls.asked) == 2 and a.is_idle and len(b.in_flight) == 2
    for k in (3, 2):
        p.on_result(b, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), 6.0)
    assert p.balancer.num_balanced == 4 and not p.balancer.rebalanced and not p.planned


async def test_near_its_share_an_engine_takes_only_what_waits_beyond_a_donors_slots() -> None:
    """Engines that take eight requests and run four: ``b``, short of its share by no
    more than its square root after a result, asks back only requests ``a`` holds
    beyond its slots (they wait in a's engine queue: nothing generated, no KV), never
    one of the four ``a`` runs -- else, as requests finish in turn, two engines near
    their shares trade running requests back and forth, each a re-prefill (the CPU
    fidelity record's replay: 91 running requests recalled in 80 recalls, an
    iteration 2.4% slower). Left with nothing, it takes running ones too."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events, join=False)
    a, b = worker("a", 8, slots=4), worker("b", 8, slots=4)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(8)], 0.0)
    start(a)  # i0..i3 run at a, i4..i7 wait in its engine's queue
    p.add_worker(b, 1.0)
    p.admit([item(k) for k in range(8, 12)], 1.0)  # all to b, the less loaded per slot
    start(b)
    assert (a.num_waiting, len(b.in_flight)) == (4, 4)
    p.on_result(b, wire.ItemResult(item=ItemId("i8"), num_tokens=5), 2.0)
    p.after_results(b, 2.0)  # holds 3 of 11, share 5: 2 short, two of a's waiting four
    assert recalls.asked == [(InstanceId("a"), (ItemId("i7"), ItemId("i6")))]
    start(b)
    for k in (0, 1):  # a now runs i2..i5: none waits
        p.on_result(a, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), 3.0)
    for k in (9, 10, 11):
        p.on_result(b, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), 4.0)
        p.after_results(b, 4.0)  # holds 4, 3, 2 of 8, 7, 6: at most 1 short
    assert len(recalls.asked) == 1 and a.num_waiting == 0
    for k in (7, 6):
        p.on_result(b, wire.ItemResult(item=ItemId(f"i{k}"), num_tokens=5), 5.0)
    p.after_results(b, 5.0)  # holds none of 4, 2 short of 2: two of the four a runs
    assert recalls.asked[1:] == [(InstanceId("a"), (ItemId("i5"), ItemId("i4")))]


def _bare_balancer(
    a: WorkerState, b: WorkerState
) -> tuple[Balancer, list[tuple[InstanceId, tuple[ItemId, ...]]]]:
    """A balancer over ``a`` and ``b`` alone (no placement around it), and the list
    of its recalls: (holder, items) each."""
    asked: list[tuple[InstanceId, tuple[ItemId, ...]]] = []
    balancer = Balancer(
        workers={a.instance: a, b.instance: b},
        peers={a.component: ComponentPeers.of([a, b])},
        planned={},
        edges_of=lambda component: {PROMPTS},
        move=lambda it, w, now: None,
        recall=lambda w, items, now: asked.append((w.instance, items)),
    )
    return balancer, asked


async def test_a_tail_shortfall_beyond_chance_moves_running_requests() -> None:
    """In the tail, running requests move once an engine is short of its share by
    more than the share's square root (how far engines that hold alike drift apart
    by random finishing order), however much it still holds: with a share of 16,
    holding 10 it takes 6; holding 13, none."""
    for held_b, taken in ((10, 6), (13, 0)):
        a, b = worker("a", 64), worker("b", 64)
        balancer, asked = _bare_balancer(a, b)
        for k in range(32 - held_b):
            a.in_flight.add(item(k))
        for k in range(32 - held_b, 32):
            b.in_flight.add(item(k))
        balancer.balance_for(b, 1.0, tail=True)
        newest = tuple(ItemId(f"i{k}") for k in range(31 - held_b, 31 - held_b - taken, -1))
        assert asked == ([(InstanceId("a"), newest)] if taken else [])


async def test_an_idle_engine_leaves_a_session_with_the_engine_holding_its_prefix() -> None:
    events: list[ev.Event] = []
    p, recalls = _balancing(events)
    a, b = worker("a", 8), worker("b", 8)
    p.add_worker(a, 0.0)
    p.add_worker(b, 0.0)
    p.admit([item(k, affinity="prefer", instance=InstanceId("a")) for k in range(4)], 0.0)
    start(a)
    p.after_results(b, 1.0)
    assert b.is_idle and not recalls.asked and len(a.in_flight) == 4


async def test_each_donor_keeps_the_sessions_whose_prefix_it_holds() -> None:
    """A joiner takes its share from several donors, each judged by its own rule: none
    gives up a session whose KV prefix it holds (a rule taken from another donor would
    let every session but that donor's move)."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events)
    a, b, c = worker("a", 8), worker("b", 8), worker("c", 8)
    p.add_worker(a, 0.0)
    p.add_worker(b, 0.0)
    p.admit([item(k, affinity="prefer", instance=InstanceId("a")) for k in range(4)], 0.0)
    p.admit([item(k, affinity="prefer", instance=InstanceId("b")) for k in range(4, 8)], 0.0)
    start(a)
    start(b)
    assert (len(a.in_flight), len(b.in_flight)) == (4, 4)
    p.add_worker(c, 1.0)  # its share: 8 * 8/24 = 2, but every session stays put
    assert not recalls.asked and c.is_idle


async def test_a_donor_found_with_nothing_to_give_is_asked_again_once_it_holds_more() -> None:
    """The balancer remembers that a donor had nothing it could take and scans its
    in-flight items again only once one is added there: ``a`` holds only requests
    moved for balance before (the tail takes none of them again), then a fresh one,
    which ``b``, below its share, then takes."""
    a, b = worker("a", 8), worker("b", 8)
    balancer, asked = _bare_balancer(a, b)
    for k in range(4):
        a.in_flight.add(item(k))
        balancer.rebalanced.add(ItemId(f"i{k}"))
    balancer.balance_for(b, 1.0, tail=True)  # share 2 of 4, but each moved once already
    assert asked == []
    balancer.balance_for(b, 1.5, tail=True)  # nothing came in: still nothing (remembered)
    assert asked == []
    a.in_flight.add(item(4))
    balancer.balance_for(b, 2.0, tail=True)
    assert asked == [(InstanceId("a"), (ItemId("i4"),))]


def test_in_flight_counts_the_items_its_worker_does_not_pin() -> None:
    held = InFlight(InstanceId("a"))
    held.add(item(0))
    held.add(item(1, affinity="prefer", instance=InstanceId("a")))  # a holds its prefix
    held.add(item(2, affinity="must", instance=InstanceId("b")))
    held.add(item(3, affinity="prefer", instance=InstanceId("b")))
    assert (len(held), held.num_unpinned, held.num_added) == (4, 2, 4)
    held.add(item(0))  # the same id again replaces it
    assert (len(held), held.num_unpinned, held.num_added) == (4, 2, 5)
    assert [i.id for i in held.unpinned_newest_first()] == ["i0", "i3"]  # i0 re-dispatched
    assert held.pop(ItemId("i3")) is not None and held.pop(ItemId("i3")) is None
    assert held.num_unpinned == 1 and list(held) == ["i1", "i2", "i0"]  # dispatch order
    held.clear()
    assert (len(held), held.num_unpinned) == (0, 0)


async def test_a_component_tally_counts_what_its_workers_queue_and_hold_until_they_leave() -> None:
    """The placement's per-component tallies follow every way an item enters or leaves
    a queue or an in-flight map, and a worker that leaves stops counting."""
    a, b = worker("a", 2), worker("b", 2)
    a.queue.put_nowait(item(0))
    peers = ComponentPeers.of([a, b])
    assert (peers.queued.count, peers.in_flight.count, peers.slots) == (1, 0, 4)
    for k in range(1, 4):
        b.queue.put_nowait(item(k))
    a.in_flight.add(a.queue.get_nowait())
    b.in_flight.add(item(9))
    assert (peers.queued.count, peers.in_flight.count, peers.held_at_most) == (3, 2, 5)
    assert b.queue.take_oldest(lambda it: it.id == "i2") is not None
    b.queue.get_batch_nowait(1)
    assert b.in_flight.pop(ItemId("i9")) is not None and peers.in_flight.count == 1
    assert peers.queued.count == 1
    peers.uncount(b)  # b leaves holding one queued item
    assert peers.queued.count == 0 and len(b.queue) == 1
    a.in_flight.clear()
    assert peers.in_flight.count == 0
    a.active = False
    peers.refresh([a, b])
    assert (peers.active, peers.slots) == ([b], 2)


async def test_a_component_counts_what_its_workers_hold_beyond_their_slots() -> None:
    """``beyond_slots`` (what the balance's O(1) answer rests on) follows adds, pops,
    re-adds, clears, a worker leaving, and holds at every step what the workers hold
    in flight beyond their slots."""
    a, b, c = worker("a", 8, slots=2), worker("b", 8, slots=3), worker("c", 8)
    peers = ComponentPeers.of([a, b, c])

    def exact() -> int:
        return sum(max(0, len(w.in_flight) - w.slots) for w in (a, b, c))

    steps = itertools.count()
    for w, k in [(a, 0), (a, 1), (a, 2), (a, 3), (b, 4), (b, 5), (b, 6), (b, 7), (c, 8)]:
        w.in_flight.add(item(k))
        assert peers.beyond_slots.count == exact(), next(steps)
    assert (peers.beyond_slots.count, a.in_flight.num_beyond_slots) == (3, 2)
    a.in_flight.add(item(3))  # the same id again: no more beyond
    assert peers.beyond_slots.count == exact() == 3
    assert a.in_flight.pop(ItemId("i0")) is not None and peers.beyond_slots.count == 2
    assert a.in_flight.pop(ItemId("i0")) is None and peers.beyond_slots.count == 2
    b.in_flight.clear()
    assert peers.beyond_slots.count == exact() == 1
    peers.uncount(a)  # a leaves holding one beyond its slots
    assert peers.beyond_slots.count == 0 and a.in_flight.num_beyond_slots == 1
    for k in range(9, 20):
        c.in_flight.add(item(k))  # no slots given: its capacity, 8
    assert peers.beyond_slots.count == c.in_flight.num_beyond_slots == 4  # a is not counted


async def test_the_tail_balance_takes_from_an_engine_only_when_one_holds_beyond_its_slots() -> None:
    """In the tail, ``b`` (one short of its share) takes nothing running from ``a``,
    whichever way the balance finds that out, until ``a`` holds more than it runs: then
    it asks that one back."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events)
    a, b = worker("a", 16, slots=8), worker("b", 16, slots=8)
    p.add_worker(a, 0.0)
    p.add_worker(b, 0.0)
    p.admit([item(k) for k in range(16)], 0.0)
    start(a)
    start(b)
    done = next(iter(b.in_flight))
    p.on_result(b, wire.ItemResult(item=done, num_tokens=5), 1.0)
    p.after_results(b, 1.0)
    assert recalls.asked == [] and (len(a.in_flight), len(b.in_flight)) == (8, 7)
    a.in_flight.add(item(20))  # a now holds one beyond its 8 slots
    p.after_results(b, 2.0)
    assert recalls.asked == [(InstanceId("a"), (ItemId("i20"),))]


async def test_without_tail_balancing_the_tail_stays_where_it_runs() -> None:
    """``b`` takes its share when it joins, runs it out, and then takes nothing more
    from ``a``'s three (with tail balancing it would take one)."""
    events: list[ev.Event] = []
    p, recalls = _balancing(events, idle=False)
    a, b = worker("a", 8), worker("b", 8)
    p.add_worker(a, 0.0)
    p.admit([item(k) for k in range(6)], 0.0)
    start(a)
    p.add_worker(b, 1.0)
    assert len(recalls.asked) == 1 and len(b.queue) == 3
    start(b)
    for it in list(b.in_flight):
        p.on_result(b, wire.ItemResult(item=it, num_tokens=5), 2.0)
    p.after_results(b, 2.0)
    assert b.is_idle and len(recalls.asked) == 1 and len(a.in_flight) == 3


async def test_an_instance_left_with_nothing_is_reported_idle_once_per_idle_spell() -> None:
    """After its results, an instance that holds nothing and could take nothing from
    the others is reported idle (``WorkerIdle``), once until it is given work again;
    one that took waiting work is not."""
    events: list[ev.Event] = []
    p = _placement(events)
    a, b = worker("a", capacity=1), worker("b", capacity=1)
    p.add_worker(a, 0.0)
    p.add_worker(b, 0.0)
    p.admit([item(0), item(1), item(2)], 0.0)
    start(a)
    start(b)

    def idle() -> list[InstanceId]:
        return [e.instance for e in events if isinstance(e, ev.WorkerIdle)]

    def finish(w: WorkerState, now: float) -> None:
        [it] = w.in_flight
        p.on_result(w, wire.ItemResult(item=it), now)
        p.after_results(w, now)

    finish(a, 1.0)  # a takes i2, waiting at b (its queue or b's)
    assert idle() == []
    start(a)
    finish(b, 2.0)
    p.after_results(b, 2.5)  # (a stale result) still idle: no second report
    assert idle() == [InstanceId("b")]
    finish(a, 3.0)
    assert idle() == [InstanceId("b"), InstanceId("a")]
    p.admit([item(3)], 4.0)  # routed to one of them: that one's spell is over
    [routed] = [e.instance for e in events if isinstance(e, ev.ItemRouted) and e.item == "i3"]
    w = a if routed == "a" else b
    start(w)
    finish(w, 5.0)
    assert idle() == [InstanceId("b"), InstanceId("a"), routed]


def test_rollout_balance_names_the_routers_balancing_and_refuses_others() -> None:
    base = RouterConfig(heartbeat_interval_s=0.5)
    assert [
        (c.balance_on_join, c.balance_below_share, c.heartbeat_interval_s)
        for c in (with_balance(base, b) for b in ("below_share", "on_join", "none"))
    ] == [(True, True, 0.5), (True, False, 0.5), (False, False, 0.5)]
    with pytest.raises(ValueError, match="balance='sometimes'"):
        with_balance(base, "sometimes")
