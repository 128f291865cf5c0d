"""Placement: where every pending item is, and where it goes next.

Synchronous bookkeeping and decisions, no sockets or awaits: the router calls it as
frames arrive. An item is pending from submission to completion and is in exactly one
place: the backlog (no instance can take it now), an instance's request queue, in
flight on that instance's worker, or out on a tool call. Every move is reported as a
control-plane event, in an order the hypergraph accepts (see :mod:`dynarl.data.router`).

It also adds up the tokens each item's results report (``ItemResult.num_tokens``: what
one instance generated for it, on top of any partial output it resumed from), so that
``ItemsRequeued`` and ``ItemCompleted`` carry a request's whole output so far, every
turn's and every instance's: the counts the hypergraph keeps per request.
"""

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from dynarl.control import events as ev
from dynarl.core.ids import ComponentId, EdgeId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.balance import Balancer, movable
from dynarl.data.component_peers import ComponentPeers
from dynarl.data.errors import RoutingError
from dynarl.data.peers import WorkerState
from dynarl.data.routing import RoutingPolicy

logger = logging.getLogger(__name__)

_MAX_REFILL_MISSES = 4


class RoutedResult(msgspec.Struct, frozen=True, kw_only=True):
    """A result handed to the caller: ``item`` as it was routed, what ``instance``
    returned for it. ``result.status`` is ``"done"``, ``"tool_call"`` (then resume
    the session with the tool's output for its next turn), ``"refused"`` (the worker
    could not serve it; the item is finished, see :attr:`refusal`) or ``"aborted"``
    (an item :meth:`Placement.withdraw` recalled: its partial output, to carry over)."""

    item: wire.Item
    result: wire.ItemResult
    instance: InstanceId

    @property
    def refusal(self) -> str | None:
        """Why the worker refused the item (``status == "refused"``), else ``None``."""
        if self.result.status != "refused":
            return None
        return self.result.payload.decode("utf-8", errors="replace")


class Placement:
    """The router's item table and its routing decisions.

    Args:
        consumers: the components that consume each edge.
        policy: chooses an instance for each item.
        emit: receives every event, synchronously, in order.
        balance_on_join: an instance that joins (or resumes) takes its fair share of
            what the other instances of its component hold (see :meth:`balance_for`);
            off, it takes only the backlog and what waits beyond another's capacity.
        balance_below_share: so does an instance that gets results back while it
            holds less than its fair share (the rollout tail), each item moved this way
            at most once (see :meth:`after_results`).
        recall: asks a worker to hand these in-flight items back now (status
            ``aborted``, with their partial output; the router sends ``Abort``), for
            :meth:`balance_for` to move them; ``None``: only queued items move.
        lost: receives, as the result no worker will send, an item :meth:`withdraw`
            recalled whose worker failed first (status ``aborted``, with the payload
            it was sent with); ``None``: it leaves unannounced.

    The balancing, and its books (what was recalled, what was moved, how many), is
    :attr:`balancer`'s (a :class:`~dynarl.data.balance.Balancer`).
    """

    def __init__(
        self,
        consumers: Mapping[EdgeId, Iterable[ComponentId]],
        *,
        policy: RoutingPolicy,
        emit: Callable[[ev.Event], object],
        balance_on_join: bool = True,
        balance_below_share: bool = True,
        recall: Callable[[WorkerState, tuple[ItemId, ...], float], object] | None = None,
        lost: Callable[[RoutedResult], object] | None = None,
    ) -> None:
        self.consumers = {e: frozenset(cs) for e, cs in consumers.items()}
        self.lost = lost
        self.policy = policy
        self.emit = emit
        self.workers: dict[InstanceId, WorkerState] = {}
        self.peers: dict[ComponentId, ComponentPeers] = {}
        """Each component's workers: the active ones, their capacity, what all hold."""
        self.candidates: dict[EdgeId, list[WorkerState]] = {e: [] for e in self.consumers}
        self.pending: set[ItemId] = set()
        self.in_tool: dict[ItemId, wire.Item] = {}
        self.backlog: deque[wire.Item] = deque()
        self.generated_tokens: dict[ItemId, int] = {}
        """Tokens each pending item's aborted and tool-call results reported: the
        length of the partial output it carries (absent: none)."""
        self.withdrawing: set[ItemId] = set()
        """Items :meth:`withdraw` recalled from the instances running them: their
        aborted results take them out of the run instead of routing them again."""
        self.num_withdrawn = 0
        self.held: set[InstanceId] = set()
        """Instances that start drained when they join (see ``Router.hold``)."""
        self.num_routed = 0
        self.num_completed = 0
        self.num_refused = 0
        self.num_requeued = 0
        self.num_workers_failed = 0
        self.num_stolen = 0
        """Queued items an instance with room took from another's queue."""
        self.planned: dict[ItemId, InstanceId] = {}
        """Where items taken back from an instance go next: a drained one's (see
        :meth:`plan`), a recalled one's (see :meth:`balance_for`)."""
        self.balancer = Balancer(
            workers=self.workers,
            peers=self.peers,
            planned=self.planned,
            edges_of=self._edges_of,
            move=self._move_queued,
            on_join=balance_on_join,
            below_share=balance_below_share,
            recall=recall,
        )
        """Moves items to an instance below its fair share (see :meth:`balance_for`)."""
        self.reported_idle: set[InstanceId] = set()
        """Instances reported idle (``WorkerIdle``) that have held nothing since."""

    # ------------------------------------------------------------------ workers

    def add_worker(self, w: WorkerState, now: float) -> None:
        """A worker joined: route to it, starting with the backlog."""
        self.workers[w.instance] = w
        self.peers.setdefault(w.component, ComponentPeers()).count(w)
        if w.instance in self.held:
            w.active = False
        self._refresh_candidates()
        self.refill(now)
        self.steal_for(w, now)
        self.balance_for(w, now)

    def set_active(self, w: WorkerState, active: bool, now: float) -> None:
        """Stop (drain) or resume routing to ``w``; stopping takes back its queued
        items and routes them elsewhere."""
        if active:
            self.held.discard(w.instance)
        if w.active != active:
            w.active = active
            self._refresh_candidates()
        if active:
            self.refill(now)
            self.steal_for(w, now)
            self.balance_for(w, now)
        else:
            self._requeue(w.queue.take_all(), now)

    def remove_worker(self, w: WorkerState) -> list[wire.Item]:
        """Forget ``w``; returns the items it held (queued, then in flight)."""
        del self.workers[w.instance]
        self.reported_idle.discard(w.instance)
        self.balancer.forget_worker(w.instance)
        items = w.queue.take_all() + list(w.in_flight.values())
        w.in_flight.clear()
        w.queue.close()
        self.peers[w.component].uncount(w)
        self._refresh_candidates()
        return items

    def fail_worker(self, w: WorkerState, reason: str, now: float) -> None:
        """``w`` died or left: report it and route everything it held elsewhere."""
        items = self.remove_worker(w)
        self.num_workers_failed += 1
        logger.warning(
            "worker %s failed: %s; routing its %d items elsewhere", w.instance, reason, len(items)
        )
        # The hypergraph puts the items a failed instance held back in their queues.
        self.emit(ev.WorkerFailed(time_s=now, instance=w.instance, reason=reason))
        leaving = [item for item in items if item.id in self.withdrawing]
        if leaving:  # recalled to leave the run: they leave from the queue instead
            self._withdrawn(leaving, now)
            if self.lost is not None:
                for item in leaving:
                    result = wire.ItemResult(item=item.id, status="aborted", payload=item.payload)
                    self.lost(RoutedResult(item=item, result=result, instance=w.instance))
        left = {item.id for item in leaving}
        for item in items:
            if item.id not in left:
                self._place(item, now)

    def plan(self, targets: Iterable[tuple[ItemId, InstanceId]]) -> None:
        """A migration's instance-level decision (``Migration.reassign``): each item,
        when next routed (taken back from the instance it drains), goes to its target
        if that is an active candidate with queue space; otherwise the policy decides.
        Call it before draining."""
        self.planned.update(targets)

    def _edges_of(self, component: ComponentId) -> set[EdgeId]:
        return {e for e, components in self.consumers.items() if component in components}

    def _refresh_candidates(self) -> None:
        for edge, components in self.consumers.items():
            self.candidates[edge] = [
                w for w in self.workers.values() if w.active and w.component in components
            ]
        for component, peers in self.peers.items():
            peers.refresh(w for w in self.workers.values() if w.component == component)

    # ------------------------------------------------------------------ items in

    def check_new(self, items: Sequence[wire.Item]) -> None:
        """Raise :class:`RoutingError` unless every item may be submitted."""
        ids = set()
        for item in items:
            if item.edge not in self.consumers:
                raise RoutingError(
                    f"item {item.id!r} is on edge {item.edge!r}, which no "
                    f"component consumes; known edges: {sorted(self.consumers)}"
                )
            if item.id in self.pending or item.id in ids:
                raise RoutingError(f"item {item.id!r} is already pending; ids must be unique")
            ids.add(item.id)

    def admit(self, items: Sequence[wire.Item], now: float) -> None:
        """Enqueue checked new items and route them. An item that carries output (a
        partial rollout's carried request, its payload the partial output) counts the
        tokens it states (``Item.generated``) from the start."""
        by_edge: dict[EdgeId, list[wire.Item]] = {}
        for item in items:
            by_edge.setdefault(item.edge, []).append(item)
            if item.generated:
                self.generated_tokens[item.id] = item.generated
        for edge, members in by_edge.items():
            refs = tuple(ev.ItemRef(i.id, i.group, i.tokens) for i in members)
            carried = tuple(i.generated for i in members)
            generated = carried if any(carried) else ()
            self.emit(ev.ItemsEnqueued(time_s=now, edge=edge, items=refs, generated=generated))
        self.pending.update(item.id for item in items)
        for item in items:
            self._place(item, now)

    def withdraw(self, item_ids: Iterable[ItemId], now: float) -> list[wire.Item]:
        """Take pending items out of the run without completing them (a partial
        rollout's iteration has the groups it trains; these carry over). Those waiting
        (in the backlog, an instance's queue, or out on a tool call) leave at once and
        are returned, with the partial output they carry as their payload; those in
        flight are recalled (the router sends ``Abort``) and leave when their aborted
        result returns, handed to the caller as a :class:`RoutedResult` with status
        ``aborted`` (or ``tool_call``, a session whose turn ended first: its tool's
        result belongs to the next iteration; one that finishes first completes as
        usual). Each leaving item is reported (``ItemsWithdrawn``, with the tokens it
        generated; submitted again, it states them: ``Item.generated``). Raises
        :class:`RoutingError`, changing nothing, for an item that is not pending, or
        whose in-flight instance cannot be asked."""
        wanted = set(item_ids)
        unknown = wanted - self.pending
        if unknown:
            raise RoutingError(f"cannot withdraw {sorted(unknown)[:3]}: not pending")
        recalls = [
            (w, running)
            for w in self.workers.values()
            if (running := tuple(i for i in w.in_flight if i in wanted))
        ]
        if recalls and self.balancer.recall is None:
            raise RoutingError("cannot withdraw items in flight: this placement cannot recall")
        taken = [item for item in self.backlog if item.id in wanted]
        if taken:
            self.backlog = deque(item for item in self.backlog if item.id not in wanted)
        for item_id in wanted & self.in_tool.keys():
            taken.append(self.in_tool.pop(item_id))
        for w in self.workers.values():
            if len(w.queue):
                taken.extend(w.queue.take_matching(lambda item: item.id in wanted))
        self._withdrawn(taken, now)
        # All are marked before any is recalled: a recall's results may move others.
        self.withdrawing.update(i for _, running in recalls for i in running)
        for w, running in recalls:
            assert self.balancer.recall is not None
            self.balancer.recall(w, running, now)
        return taken

    def _withdrawn(self, items: Sequence[wire.Item], now: float) -> None:
        """Items that no instance holds leave the run (see :meth:`withdraw`)."""
        for edge, ids in _by_edge(items).items():
            generated = tuple(self.generated_tokens.pop(i, 0) for i in ids)
            self.emit(
                ev.ItemsWithdrawn(time_s=now, edge=edge, items=tuple(ids), generated=generated)
            )
        for item in items:
            self.pending.discard(item.id)
            self.withdrawing.discard(item.id)
            self.balancer.on_completed(item.id)
            self.planned.pop(item.id, None)
        self.num_withdrawn += len(items)

    def resume(
        self, item_id: ItemId, payload: bytes, now: float, *, latency_s: float, ok: bool
    ) -> None:
        """The next turn of a session back from a tool call."""
        item = self.in_tool.pop(item_id, None)
        if item is None:
            raise RoutingError(f"item {item_id!r} is not out on a tool call")
        self.emit(
            ev.ToolCallFinished(
                time_s=now, edge=item.edge, item=item_id, latency_s=latency_s, ok=ok
            )
        )
        self._place(
            msgspec.structs.replace(item, payload=payload, tool_calls=item.tool_calls + 1), now
        )

    def finish(self, item_id: ItemId, now: float) -> InstanceId:
        """A session out on a tool call is over (its environment ended it): it completes
        on the instance that served its last turn, with every turn's tokens; that
        instance is returned."""
        item = self.in_tool.pop(item_id, None)
        if item is None:
            raise RoutingError(f"item {item_id!r} is not out on a tool call")
        assert item.instance is not None, "a session in a tool call was served"
        self.pending.discard(item_id)
        self.balancer.on_completed(item_id)
        self.num_completed += 1
        self.emit(
            ev.ItemCompleted(
                time_s=now,
                edge=item.edge,
                item=item_id,
                instance=item.instance,
                num_tokens=self.generated_tokens.pop(item_id, 0),
            )
        )
        return item.instance

    def on_result(self, w: WorkerState, r: wire.ItemResult, now: float) -> RoutedResult | None:
        """Apply one result from ``w``; the completion to hand to the caller, if any.
        Raises :class:`RoutingError` if ``w`` does not hold the item (a stale result)."""
        item = w.in_flight.pop(r.item)
        if item is None:
            raise RoutingError(f"{w.instance!r} returned {r.item!r}, which it does not hold")
        generated = self.generated_tokens.pop(item.id, 0) + r.num_tokens
        self.balancer.on_result(item.id, r.status)
        if item.id in self.withdrawing and r.status in ("aborted", "tool_call"):
            if generated:
                self.generated_tokens[item.id] = generated
            self._withdrawn([item], now)
            return RoutedResult(item=item, result=r, instance=w.instance)
        self.withdrawing.discard(item.id)
        if r.status in ("done", "refused"):
            self.pending.discard(item.id)
            self.balancer.on_completed(item.id)
            if self.planned:
                self.planned.pop(item.id, None)
            self.num_completed += 1
            if r.status == "refused":
                self.num_refused += 1
                logger.warning(
                    "%s refused item %s: %s",
                    w.instance,
                    item.id,
                    r.payload.decode("utf-8", errors="replace"),
                )
            self.emit(
                ev.ItemCompleted(
                    time_s=now,
                    edge=item.edge,
                    item=item.id,
                    instance=w.instance,
                    num_tokens=generated,
                )
            )
            return RoutedResult(item=item, result=r, instance=w.instance)
        if generated:
            self.generated_tokens[item.id] = generated
        served = msgspec.structs.replace(
            item, payload=r.payload, instance=w.instance, prefix_tokens=r.prefix_tokens
        )
        if r.status == "tool_call":
            self.in_tool[item.id] = served
            self.emit(
                ev.ToolCallStarted(
                    time_s=now,
                    edge=item.edge,
                    item=item.id,
                    instance=w.instance,
                    prefix_tokens=r.prefix_tokens,
                )
            )
            return RoutedResult(item=item, result=r, instance=w.instance)
        self._requeue([served], now)  # aborted: routed again with its partial output
        return None

    # ------------------------------------------------------------------ routing

    def _place(self, item: wire.Item, now: float) -> None:
        candidates = self.candidates[item.edge]
        previous = None
        if item.instance is not None and item.affinity != "none":
            prev = self.workers.get(item.instance)
            if prev is not None and prev.active and prev in candidates:
                previous = prev
        planned = self.planned.pop(item.id, None) if self.planned else None
        target = self.workers.get(planned) if planned is not None else None
        if target is None or target not in candidates or target.is_full:
            target = self.policy.select(item, previous, candidates)
        if target is None:
            self.backlog.append(item)
            return
        target.queue.put_nowait(item, now_s=now)
        self.num_routed += 1
        self.reported_idle.discard(target.instance)
        self.emit(ev.ItemRouted(time_s=now, edge=item.edge, item=item.id, instance=target.instance))

    def steal_for(self, w: WorkerState, now: float) -> None:
        """``w`` has room (an item routed to it now would start at once): give it items
        other active instances of its component queue beyond their room, oldest first,
        from the one with the most items waiting, until ``w`` is full or none is left.
        An item whose KV prefix its instance holds moves only to an idle ``w``: an idle
        instance's time is worth the re-prefill, while a busy one would stall its batch
        for it; an item that must return to its instance never moves. Called when
        ``w`` joins, resumes, or gets results back."""
        if not (w.active and w.can_start_now):
            return
        peers = self.peers[w.component]
        if peers.queued.count == len(w.queue):
            return  # no other instance queues anything (the common case)
        donors = [c for c in peers.active if len(c.queue) and c is not w and c.num_waiting]
        edges = self._edges_of(w.component)
        while donors and w.can_start_now:
            donor = max(donors, key=lambda c: c.num_waiting)
            # Once ``w`` holds an item it is busy: only items whose prefix the donor
            # does not hold may follow.
            item = donor.queue.take_oldest(
                functools.partial(movable, edges=edges, sticky=None if w.is_idle else donor)
            )
            if item is None or not donor.num_waiting:
                donors.remove(donor)
            if item is None:
                continue
            self.num_stolen += 1
            self._move_queued(item, w, now)

    def after_results(self, w: WorkerState, now: float) -> None:
        """Results from ``w`` were applied: give it the work waiting elsewhere
        (:meth:`steal_for`), then, if it holds less than its fair share, its share of
        what the others hold (:meth:`balance_for` with ``tail``); if it is still left
        with nothing, report it idle (``WorkerIdle``, once per idle spell): nothing its
        component holds could move to it, so the device it holds is spare until new
        work arrives."""
        self.steal_for(w, now)
        self.balance_for(w, now, tail=True)
        if w.active and w.is_idle and w.instance not in self.reported_idle:
            self.reported_idle.add(w.instance)
            self.emit(ev.WorkerIdle(time_s=now, instance=w.instance))

    def balance_for(self, w: WorkerState, now: float, *, tail: bool = False) -> None:
        """``w`` joined or resumed (or, with ``tail``, got results back): move to
        it its fair share of what the other instances of its component hold (see
        :meth:`Balancer.balance_for <dynarl.data.balance.Balancer.balance_for>`)."""
        self.balancer.balance_for(w, now, tail=tail)

    def _move_queued(self, item: wire.Item, w: WorkerState, now: float) -> None:
        """Queue ``item``, just taken from another instance's queue, at ``w``: reported
        requeued (with its partial output) and routed again."""
        generated = (self.generated_tokens.get(item.id, 0),)
        self.emit(
            ev.ItemsRequeued(time_s=now, edge=item.edge, items=(item.id,), generated=generated)
        )
        self.num_requeued += 1
        w.queue.put_nowait(item, now_s=now)
        self.num_routed += 1
        self.reported_idle.discard(w.instance)
        self.emit(ev.ItemRouted(time_s=now, edge=item.edge, item=item.id, instance=w.instance))

    def refill(self, now: float) -> None:
        """Route backlogged items, oldest first, until a few in a row find no instance
        with room (those go to the back), so each call costs O(items placed)."""
        misses = 0
        for _ in range(len(self.backlog)):
            n = len(self.backlog)
            self._place(self.backlog.popleft(), now)
            if len(self.backlog) == n:  # it went back: no room for it
                misses += 1
                if misses >= _MAX_REFILL_MISSES:
                    return
            else:
                misses = 0

    def _requeue(self, items: list[wire.Item], now: float) -> None:
        """Report items taken back from an instance, each with the tokens of the
        partial output it keeps, and route them again."""
        for edge, ids in _by_edge(items).items():
            generated = tuple(self.generated_tokens.get(i, 0) for i in ids)
            self.emit(
                ev.ItemsRequeued(time_s=now, edge=edge, items=tuple(ids), generated=generated)
            )
        self.num_requeued += len(items)
        for item in items:
            self._place(item, now)


def _by_edge(items: Iterable[wire.Item]) -> dict[EdgeId, list[ItemId]]:
    """The ids of ``items`` by edge, in order (one event per edge)."""
    by_edge: dict[EdgeId, list[ItemId]] = {}
    for item in items:
        by_edge.setdefault(item.edge, []).append(item.id)
    return by_edge
