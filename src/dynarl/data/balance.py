"""Balance: bring an instance that joins, resumes or runs dry up to its fair share.

The :class:`~dynarl.data.placement.Placement` owns a :class:`Balancer` and calls it
when an instance of a component gets room; the balancer moves to that instance its
share of what the others hold: queued items at once, in-flight ones by recalling them
(their aborted results are then routed to it). It keeps the books this takes: which
items are on their way back from a recall, and which were moved for balance already
(a request is re-prefilled for balance at most once). Synchronous, like the placement.
"""

import functools
import heapq
import math
from collections.abc import Callable, Iterator, Mapping

from dynarl.core.ids import ComponentId, EdgeId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.component_peers import ComponentPeers
from dynarl.data.in_flight import InFlight, pinned_to
from dynarl.data.peers import WorkerState


def movable(
    item: wire.Item,
    *,
    edges: set[EdgeId],
    sticky: WorkerState | None,
    exclude: set[ItemId] | None = None,
) -> bool:
    """Whether ``item`` may move to another instance (taken from a queue by
    ``Placement.steal_for``, or by :meth:`Balancer.balance_for`): never one that must
    return to its instance, none off ``edges``, none whose prefix ``sticky`` holds,
    none in ``exclude``."""
    return (
        item.affinity != "must"
        and item.edge in edges
        and (sticky is None or not pinned_to(item, sticky.instance))
        and (exclude is None or item.id not in exclude)
    )


def _one_waiting(donor: WorkerState, waiting: dict[InstanceId, int]) -> bool:
    """Whether ``donor`` holds one more item beyond its slots than this scan asked back
    (``waiting``: what it has left so, per donor; one is counted asked back)."""
    left = waiting.get(donor.instance, donor.num_waiting)
    waiting[donor.instance] = left - 1
    return left > 0


class Balancer:
    """Moves items to an instance below its fair share, and remembers what it moved.

    Args:
        workers: the placement's workers, by instance (read, never changed here).
        peers: the placement's workers by component (read, never changed here).
        planned: the placement's plan of where items go when next routed; recalled
            items are planned to the instance they were recalled for.
        edges_of: the edges a component consumes.
        move: queues an item just taken from another instance's queue at an instance
            (reported requeued and routed).
        on_join: an instance that joins or resumes takes its fair share (see
            :meth:`balance_for`).
        below_share: so does an instance that gets results back while it holds less
            than its fair share (the rollout tail: the engines that finished take
            their share of the long requests), each item moved this way at most once.
        recall: asks a worker to hand these in-flight items back now (their results
            come back ``aborted``, with their partial output); ``None``: only queued
            items move.
    """

    def __init__(
        self,
        *,
        workers: Mapping[InstanceId, WorkerState],
        peers: Mapping[ComponentId, ComponentPeers],
        planned: dict[ItemId, InstanceId],
        edges_of: Callable[[ComponentId], set[EdgeId]],
        move: Callable[[wire.Item, WorkerState, float], None],
        on_join: bool = True,
        below_share: bool = True,
        recall: Callable[[WorkerState, tuple[ItemId, ...], float], object] | None = None,
    ) -> None:
        self.workers = workers
        self.peers = peers
        self.planned = planned
        self.edges_of = edges_of
        self.move = move
        self.on_join = on_join
        self.below_share = below_share
        self.recall = recall
        self.num_balanced = 0
        """Items moved by :meth:`balance_for`: queued ones moved, in-flight ones recalled."""
        self.recalled: dict[ItemId, tuple[InstanceId, InstanceId]] = {}
        """In-flight items asked back for a joining instance: (holder, joiner) each,
        until their result arrives."""
        self.rebalanced: set[ItemId] = set()
        """Pending items moved by :meth:`balance_for` (a balance of the tail takes none
        of them: a request is re-prefilled for balance at most once)."""
        self._exhausted: dict[tuple[InFlight, bool], int] = {}
        # (a donor's in-flight items, tail) -> their num_added when a scan found none
        # to recall (keyed by the object: a worker joining again under the same
        # instance starts afresh). Until an item is added there, none can be found:
        # an item stops being recalled or rebalanced only as its result comes back
        # (it leaves the donor) or as a worker leaves (forget_worker clears this).

    def forget_worker(self, instance: InstanceId) -> None:
        """``instance`` left: forget the recalls from it and for it."""
        self._exhausted.clear()
        if self.recalled:
            for item in [i for i, (src, dst) in self.recalled.items() if instance in (src, dst)]:
                del self.recalled[item]

    def on_result(self, item: ItemId, status: wire.ResultStatus) -> None:
        """A result for ``item`` arrived: it is no longer on its way back from a recall;
        if that result is not the ``aborted`` one the recall asked for (the item ended
        its turn before the recall landed), it no longer goes to the instance it was
        recalled for either."""
        if item in self.recalled:
            del self.recalled[item]
            if status != "aborted":
                self.planned.pop(item, None)

    def on_completed(self, item: ItemId) -> None:
        """``item`` is no longer pending (done, refused, or its session ended): forget
        that it was moved for balance."""
        self.rebalanced.discard(item)

    def balance_for(self, w: WorkerState, now: float, *, tail: bool = False) -> None:
        """``w`` joined or resumed (or, with ``tail``, got results back): move to
        it its fair share of what the active instances of its component hold, so that
        a backlog is not all run by whichever instance happened to join first while the
        others, joining moments later, find nothing waiting beyond its capacity (what
        ``Placement.steal_for`` takes); and so that in the rollout tail no engine
        decodes a batch of long requests while others run a few (with ``tail``, ``w``
        takes only items no balance moved before: each is re-prefilled for balance at
        most once).

        The share is by slots (what each runs at once): ``w`` is brought up to ``held *
        slots(w) / slots(all)`` items (at most its capacity), taken from the instances
        holding the most beyond their own share, each down to its share: queued items
        first (oldest first: they move as they are), then in-flight ones, most recently
        dispatched first (they have generated least): these are recalled (see
        ``recall``) and routed to ``w`` when their aborted result comes back, with
        their partial output. In the tail (``tail``), running items are asked back only
        for an instance short of its share by more than the share's square root:
        engines that hold alike and finish requests in random order drift about that
        far apart by chance, and chasing that drift trades running requests back and
        forth as each finishes, each move a re-prefill that stalls the taker's batch
        (replaying the CPU fidelity record, moving them for any shortfall: 80 recalls
        of 310 requests, 91 of them running, an iteration 2.4% slower). Within it,
        ``w`` takes only what a donor holds beyond its slots (waiting in the donor's
        engine queue: nothing generated, no KV). Items already recalled count where
        they are going (a donor's share may be paid with items still on their way to
        it: they are sent on to ``w``). Items that must return to their instance never
        move, nor do sessions whose KV prefix the donor holds (their next turn is worth
        more there than a re-prefill of the whole context elsewhere). Off with
        ``on_join=False`` (``below_share=False``)."""
        if not ((self.below_share if tail else self.on_join) and w.active and w.can_start_now):
            return
        component = self.peers[w.component]
        peers = component.active
        if len(peers) < 2:
            return
        if not self.recalled:
            # O(1) answers from what all the component's workers hold (draining ones
            # too: at least what the active ones hold), before the exact sums below.
            mine = len(w.in_flight) + len(w.queue)
            most = min(w.capacity, component.held_at_most * w.slots // component.slots)
            if mine >= most:
                return  # it holds its share already (the exact share is no more)
            if (
                tail
                and (most - mine) ** 2 <= most
                and component.queued.count == len(w.queue)
                and component.beyond_slots.count == w.in_flight.num_beyond_slots
            ):
                # No running request may move (for any share up to ``most``, the
                # shortfall's square is within the share: see ``running_too``) and no
                # other instance queues anything or holds more than it runs: the scan
                # below would find nothing (in an agentic rollout, most scans).
                return
        held: dict[InstanceId, int] = {}
        # Whether another instance holds an item that can move without its engine
        # losing work: one in its request queue, or one beyond its slots (waiting in
        # its engine's own queue).
        spare = False
        for c in peers:
            n = held[c.instance] = len(c.in_flight) + len(c.queue)
            if not spare and c is not w and (n > c.slots or len(c.queue)):
                spare = True
        coming: dict[InstanceId, list[ItemId]] = {}  # recalled items on their way to each
        for item_id, (src, dst) in self.recalled.items():
            if src in held:
                held[src] -= 1
            if dst in held:
                held[dst] += 1
                coming.setdefault(dst, []).append(item_id)
        total = sum(held.values())
        slots = sum(c.slots for c in peers)
        share = min(w.capacity, total * w.slots // slots)
        want = share - held[w.instance]
        if want <= 0:
            return
        # In the tail, running requests move only to an instance short of its share by
        # more than chance would leave it (its square root); within that, only what a
        # donor holds beyond its slots (waiting in its engine's queue: no KV, nothing
        # generated) is asked back.
        running_too = not tail or want * want > share
        if not (running_too or spare or self.recalled):
            # Only running requests could move, and none may: the scan below would
            # find nothing (in a rollout's tail, most scans; a sixth of an agentic
            # simulation's time went to them).
            return
        waiting: dict[InstanceId, int] = {}  # per donor: what it holds beyond its slots
        edges = self.edges_of(w.component)
        exclude = self.rebalanced if tail else None
        heap: list[tuple[int, InstanceId]] = []
        for c in peers:  # (donors with nothing they could give left out)
            surplus = held[c.instance] - math.ceil(total * c.slots / slots)
            if (
                surplus > 0
                and c is not w
                and (len(c.queue) or c.instance in coming or self._may_recall(c.in_flight, tail))
            ):
                heap.append((-surplus, c.instance))
        heapq.heapify(heap)
        recalls: dict[InstanceId, list[ItemId]] = {}
        # Each donor's movable in-flight items, most recently dispatched first: made when
        # the donor is first asked for one (most never are), by its own rule.
        in_flight: dict[InstanceId, Iterator[wire.Item]] = {}
        while want > 0 and heap:
            neg, iid = heapq.heappop(heap)
            donor = self.workers[iid]
            may_move = functools.partial(movable, edges=edges, sticky=donor, exclude=exclude)
            if (
                self._take_queued(donor, w, may_move, now)
                or self._redirect_one(coming.get(iid), w)
                or (
                    (running_too or _one_waiting(donor, waiting))
                    and self._recall_one(donor, w, may_move, in_flight, recalls, tail=tail)
                )
            ):
                want -= 1
                if neg < -1:
                    heapq.heappush(heap, (neg + 1, iid))
        for iid, ids in recalls.items():
            assert self.recall is not None
            self.recall(self.workers[iid], tuple(ids), now)

    def _take_queued(
        self,
        donor: WorkerState,
        w: WorkerState,
        may_move: Callable[[wire.Item], bool],
        now: float,
    ) -> bool:
        """Move ``donor``'s oldest movable queued item to ``w``; whether there was one."""
        item = donor.queue.take_oldest(may_move) if len(donor.queue) else None
        if item is None:
            return False
        self.num_balanced += 1
        self.rebalanced.add(item.id)
        self.move(item, w, now)
        return True

    def _redirect_one(self, coming: list[ItemId] | None, w: WorkerState) -> bool:
        """Send to ``w`` instead one of the items recalled for the donor and not back
        yet (``coming``); whether there was one."""
        if not coming:
            return False
        item = coming.pop()
        src, _ = self.recalled[item]
        self.recalled[item] = (src, w.instance)
        self.planned[item] = w.instance
        return True

    def _may_recall(self, held: InFlight, tail: bool) -> bool:
        """Whether a donor holding ``held`` in flight may have one to recall: not if
        there is no recall, if it pins all it holds, or if nothing came in since a scan
        (of this kind) found none."""
        return (
            self.recall is not None
            and held.num_unpinned > 0
            and self._exhausted.get((held, tail)) != held.num_added
        )

    def _recall_one(
        self,
        donor: WorkerState,
        w: WorkerState,
        may_move: Callable[[wire.Item], bool],
        candidates: dict[InstanceId, Iterator[wire.Item]],
        recalls: dict[InstanceId, list[ItemId]],
        *,
        tail: bool,
    ) -> bool:
        """Mark the next of ``donor``'s in-flight items that ``may_move`` (most recently
        dispatched first; ``candidates`` keeps each donor's place) for recall to ``w``;
        whether there was one."""
        held = donor.in_flight
        if not self._may_recall(held, tail):
            return False
        found = candidates.get(donor.instance)
        if found is None:
            recalled = self.recalled
            found = candidates[donor.instance] = (
                item
                for item in held.unpinned_newest_first()
                if item.id not in recalled and may_move(item)
            )
        item = next(found, None)
        if item is None:
            self._exhausted[held, tail] = held.num_added
            return False
        self.recalled[item.id] = (donor.instance, w.instance)
        self.planned[item.id] = w.instance
        self.rebalanced.add(item.id)
        recalls.setdefault(donor.instance, []).append(item.id)
        self.num_balanced += 1
        return True
