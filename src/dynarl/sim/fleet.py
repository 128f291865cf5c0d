"""The rollout side of :class:`~dynarl.sim.world.SimWorld`: its modelled engines behind the
real data plane's placement.

Requests are routed by :class:`~dynarl.data.placement.Placement`, the data router's own
bookkeeping and decisions, as in a real run: each modelled engine is a
:class:`~dynarl.data.peers.WorkerState` with the capacity a real slot announces
(:data:`~dynarl.workers.config.SLOT_CAPACITY` requests, more than the engine runs at
once: it queues the rest in its own queue, in the run's request order, as real engines
do) and the slots a real rollout slot announces (its engine's batch,
``max_running_requests``: what routing, stealing and balance count as room) and the real
:class:`~dynarl.data.request_queue.RequestQueue` in front of it (FIFO or tool-call
priority, with the aging bound), the :class:`~dynarl.data.routing.AffinityRouting`
policy (seeded with the run's seed) places each request, and an engine with room takes
the requests waiting elsewhere (``Placement.steal_for``). What a worker's link would
carry is played here: an engine is fed from its queue up to its capacity, and what it
finishes, aborts or stops for a tool call comes back as the
:class:`~dynarl.data.wire.ItemResult` a real engine would send. Placement reports every
move (``ItemsEnqueued``, ``ItemRouted``, ``ItemsRequeued``, ``ToolCallStarted``,
``ToolCallFinished``, ``ItemCompleted``, ``WorkerFailed``). Each engine (a
:class:`~dynarl.sim.engine.SimEngine`) advances only when it has an event due; a turn
ending in a tool call leaves the engine for the call's latency. Finished requests go to
the world's ``finished`` callback, which hands them downstream.
"""

import heapq
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.clock import Clock
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import order_named
from dynarl.data.routing import AffinityRouting
from dynarl.data.transport import PeerId
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.engine import SimEngine
from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.jobs import Job, JobDone, JobProgress
from dynarl.sim.metrics import WorldTotals
from dynarl.sim.progress import EngineSlot, SeqProgress
from dynarl.workers.config import SLOT_CAPACITY, RolloutConfig


class QueuedRequest(NamedTuple):
    """What the request order reads of a request reaching an engine's queue."""

    tool_calls: int
    prefix_tokens: int
    enqueued_s: float


class EngineFleet:
    """The live rollout engines, the data plane's placement in front of them and the
    tool calls out.

    Args:
        graph: the controller's hypergraph, read to see the rollout instances.
        emit: where events go (``Controller.handle``).
        clock: the controller's clock (where the request queues measure waits).
        rollout: the engines' limits.
        request_order: the order of the queue in front of each engine (``fifo`` or
            ``priority``).
        seed: seed of the routing policy's random choices.
        cluster: the cost models (the engines' model).
        seqs: every request's progress, shared with the world.
        totals: the world's counters.
        finished: called with an engine and the requests it finished (their last turn),
            before their ``ItemCompleted`` is reported.
        router: the data router's configuration (queue sizes, stickiness, aging).
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        clock: Clock,
        rollout: RolloutConfig,
        *,
        request_order: str,
        seed: int,
        cluster: ClusterModel,
        seqs: dict[ItemId, SeqProgress],
        totals: WorldTotals,
        finished: Callable[[InstanceId, list[SeqProgress]], None],
        router: RouterConfig | None = None,
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.clock = clock
        self.cluster = cluster
        self.seqs = seqs
        self.totals = totals
        self.finished = finished
        self.router = router or RouterConfig()
        self.order = order_named("priority" if request_order == "priority" else "fifo")
        self.placement = Placement(
            {PROMPTS: (ROLLOUT,)},
            policy=AffinityRouting(seed=seed),
            emit=self._placement_event,
            balance_on_join=self.router.balance_on_join,
            balance_below_share=self.router.balance_below_share,
            recall=self._recall,
        )
        self.cap = SLOT_CAPACITY
        self.batch = rollout.max_running_requests
        self._ranked = request_order == "priority"
        self.engines: dict[InstanceId, EngineSlot] = {}
        self._eheap: list[tuple[float, InstanceId]] = []
        self._tools: list[tuple[float, int, ItemId]] = []
        self._tool_call: dict[ItemId, int] = {}  # each session's call out: its number
        self._tools_dropped: set[int] = set()  # calls of withdrawn sessions, still out
        self._tool_seq = 0
        self._touched: dict[InstanceId, None] = {}
        # Engines that may have room and queued requests (see route), by their order,
        # with a heap of (order, id) to visit them in that order.
        self._feed: dict[InstanceId, int] = {}
        self._feed_heap: list[tuple[int, InstanceId]] = []
        self._joined = 0
        self.slowdown = 1.0  # the host's: engines' work takes this many times its alone time
        self._wide: dict[int, EngineConfig] = {}  # engine models at other sizes, by tp

    def sync(self, now: float) -> None:
        """Create modelled engines for active rollout instances that have none; each
        joins the placement (taking the backlog and requests waiting elsewhere)."""
        for node in self.graph.components[ROLLOUT].active_instances():
            if node.id not in self.engines:
                config = self._engine_config(len(node.devices))
                sim = SimEngine(config, instance=node.id, start_s=now)
                sim.set_slowdown(self.slowdown)
                w = WorkerState.configured(
                    PeerId(node.id.encode()),
                    instance=node.id,
                    component=ROLLOUT,
                    capacity=self.cap,
                    slots=self.batch,
                    config=self.router,
                    order=self.order,
                    clock=self.clock,
                    now_s=now,
                )
                self._joined += 1
                self.engines[node.id] = EngineSlot(sim, w, order=self._joined)
                self._touched[node.id] = None
                self._may_feed(node.id)
                self.placement.add_worker(w, now)

    def _engine_config(self, num_devices: int) -> EngineConfig:
        """The modelled engine of an instance on ``num_devices`` devices: the cluster's,
        at that tensor-parallel size (engines regrouped for the rollout's tail are
        wider; the KV capacity follows from their memory)."""
        engine = self.cluster.engine
        if num_devices == engine.tp:
            return engine
        wide = self._wide.get(num_devices)
        if wide is None:
            wide = self._wide[num_devices] = msgspec.structs.replace(engine, tp=num_devices)
        return wide

    def admit(self, seqs: Sequence[SeqProgress], now: float) -> None:
        """New requests, or carried ones with what they generated: reported and
        routed (``ItemsEnqueued``, ``ItemRouted``)."""
        self.placement.admit(
            [
                wire.Item(
                    id=s.request.id,
                    group=s.request.group,
                    edge=PROMPTS,
                    affinity="prefer",
                    tokens=s.request.prompt_tokens,
                    generated=s.generated(),
                )
                for s in seqs
            ],
            now,
        )

    def set_slowdown(self, factor: float, now: float) -> None:
        """From ``now`` on, every engine's work takes ``factor`` times its alone time
        (what is left of a running step or prefill included)."""
        self.slowdown = factor
        for iid, e in list(self.engines.items()):
            if e.sim.next_event_time() == math.inf:
                e.sim.set_slowdown(factor)
                continue
            done = e.sim.advance_to(max(now, e.sim.now))
            if done:  # due within the clock's tolerance: handle them first
                self._completed(iid, e, done, now)
            e.sim.set_slowdown(factor)
            if done:
                self._schedule(iid, e, now)
            elif (t := e.sim.next_event_time()) < math.inf:
                heapq.heappush(self._eheap, (t, iid))

    def busy(self) -> list[InstanceId]:
        """The engines with a request running or prefilling."""
        return [iid for iid, e in self.engines.items() if e.busy_since is not None]

    def busy_devices(self) -> int:
        """The devices of the engines with a request running or prefilling."""
        return sum(e.sim.config.tp for e in self.engines.values() if e.busy_since is not None)

    def decode_rates_alone(self) -> tuple[float, float]:
        """Tokens and responses a second every engine's running batch generates, at
        the engines' alone speed (:meth:`SimEngine.decode_rates_alone`)."""
        tokens = responses = 0.0
        for e in self.engines.values():
            t, r = e.sim.decode_rates_alone()
            tokens, responses = tokens + t, responses + r
        return tokens, responses

    def next_time(self) -> float:
        """When the next engine event or tool return is due (``inf`` if none)."""
        while self._eheap and self._stale(*self._eheap[0]):
            heapq.heappop(self._eheap)
        times = [math.inf]
        if self._eheap:
            times.append(self._eheap[0][0])
        if self._tools:
            times.append(self._tools[0][0])
        return min(times)

    def _stale(self, t: float, iid: InstanceId) -> bool:
        e = self.engines.get(iid)
        return e is None or e.sim.next_event_time() != t

    def advance(self, now: float, due_s: float) -> None:
        """Handle the tool returns and engine events due by ``due_s``."""
        while self._tools and self._tools[0][0] <= due_s:
            _, call, item = heapq.heappop(self._tools)
            if call in self._tools_dropped:
                self._tools_dropped.discard(call)
                continue
            del self._tool_call[item]
            self._tool_returned(item, now)
        while self._eheap and self._eheap[0][0] <= due_s:
            t, iid = heapq.heappop(self._eheap)
            if not self._stale(t, iid):
                self._touch(iid, now)

    def report(self, now: float, *, all_engines: bool) -> None:
        """Emit engine stats as of ``now``, as a real slot's load reporter
        (:mod:`dynarl.workers.load_reports`) sends them: every engine's on schedule
        (``all_engines``), and between those only those of the engines that ran out of
        requests since the last report (a rollout's end for them: their counts are
        final for what they were given). The controller stamps a report with its
        arrival time, so an engine whose clock lags (no event of its own since) is
        brought to ``now`` first. The placement reads each report's KV usage, as the
        data router does (so, like it, it routes on usage up to a period old)."""
        if all_engines:
            self._touched.update(dict.fromkeys(self.engines))
        touched, self._touched = self._touched, {}
        for iid in touched:
            e = self.engines.get(iid)
            if e is None or not (all_engines or e.sim.next_event_time() == math.inf):
                continue
            if e.sim.now < now:
                self._touch(iid, now)
            stats = e.sim.stats()
            e.worker.kv_usage = stats.kv_usage
            self.emit(stats)
        self._touched.clear()

    def _touch(self, iid: InstanceId, now: float) -> None:
        """Bring engine ``iid`` to ``now`` and handle what finished meanwhile."""
        e = self.engines[iid]
        done = e.sim.advance_to(max(now, e.sim.now))
        if done:
            self._completed(iid, e, done, now)
        self._schedule(iid, e, now)

    def _schedule(self, iid: InstanceId, e: EngineSlot, now: float) -> None:
        t = e.sim.next_event_time()
        if t < math.inf:
            heapq.heappush(self._eheap, (t, iid))
            if e.busy_since is None:
                e.busy_since = now
        elif e.busy_since is not None:
            e.busy_s += now - e.busy_since
            e.busy_since = None
        self._touched[iid] = None

    def _completed(self, iid: InstanceId, e: EngineSlot, done: list[JobDone], now: float) -> None:
        """Hand what engine ``iid`` finished back to the placement, as its worker's
        results would be: a tool call, or a request's last turn (reported downstream
        first)."""
        w, on_result = e.worker, self.placement.on_result
        self._may_feed(iid)
        finals: list[JobDone] = []
        for d in done:
            seq = self.seqs[d.id]
            seq.done += d.generated_tokens
            self.totals.generated_tokens += d.generated_tokens
            if d.tool_call:
                result = wire.ItemResult(
                    item=d.id,
                    status="tool_call",
                    num_tokens=d.generated_tokens,
                    prefix_tokens=d.context_tokens,
                )
                on_result(w, result, now)
                if d.id not in self.placement.in_tool:
                    # Withdrawn as its turn ended (a partial rollout's end, see
                    # withdraw_pending): it takes the tool's result with it.
                    self._next_turn(seq)
                    continue
                self._tool_seq += 1
                latency = seq.request.tool_latency_s[seq.turn]
                heapq.heappush(self._tools, (d.time_s + latency, self._tool_seq, d.id))
                self._tool_call[d.id] = self._tool_seq
            else:
                finals.append(d)
        if finals:
            self.finished(iid, [self.seqs[d.id] for d in finals])
            for d in finals:
                on_result(w, wire.ItemResult(item=d.id, num_tokens=d.generated_tokens), now)
        self.placement.after_results(w, now)

    def _tool_returned(self, item: ItemId, now: float) -> None:
        seq = self.seqs[item]
        r = seq.request
        ok, latency = r.tool_ok[seq.turn], r.tool_latency_s[seq.turn]
        self._next_turn(seq)
        self.placement.resume(item, b"", now, latency_s=latency, ok=ok)

    def _next_turn(self, seq: SeqProgress) -> None:
        seq.turn += 1
        seq.done = 0
        seq.tool_calls += 1
        self.totals.tool_calls += 1

    def withdraw_pending(self, now: float) -> None:
        """A partial rollout's end (:mod:`dynarl.sim.partial`): every pending request
        leaves the rollout, keeping every token it generated (running ones are aborted,
        as a worker does on ``Abort``). A session out on a tool call takes the tool's
        result with it: its next turn is where it resumes (the call's remaining latency,
        at most the tool timeout, overlaps the iteration's scoring and training)."""
        p = self.placement
        for item in p.in_tool:
            self._tools_dropped.add(self._tool_call.pop(item))
            self._next_turn(self.seqs[item])
        p.withdraw(list(p.pending), now)

    def route(self, now: float) -> None:
        """Feed each engine from its queue up to its capacity (a worker link's pump),
        in the order the engines joined.

        Only engines marked by :meth:`_may_feed` are looked at: an engine fed here is
        left full or with an empty queue, and only a request routed to it (reported
        ``ItemRouted``) or a result freeing room (:meth:`_completed`,
        :meth:`_aborted`) changes that. An engine marked while this pass feeds
        engines that joined later is fed in this pass, one marked behind it in the
        next, as a pass over every engine in order would."""
        p = self.placement
        if p.backlog:
            p.refill(now)
        heap, feed = self._feed_heap, self._feed
        last = -1
        behind: list[tuple[int, InstanceId]] = []
        while heap:
            order, iid = heapq.heappop(heap)
            if feed.get(iid) != order:
                continue  # fed since, or gone
            if order <= last:
                behind.append((order, iid))
                continue
            del feed[iid]
            last = order
            e = self.engines[iid]
            w = e.worker
            room = self.cap - len(w.in_flight)
            if room <= 0 or not len(w.queue):
                continue
            batch = w.queue.get_batch_nowait(room)
            for item in batch:
                w.in_flight.add(item)
            done = e.sim.advance_to(max(now, e.sim.now))
            e.sim.submit([self._job(item, now) for item in batch])
            if done:
                self._completed(iid, e, done, now)
            self._schedule(iid, e, now)
        for entry in behind:
            heapq.heappush(heap, entry)

    def _job(self, item: wire.Item, now: float) -> Job:
        """What is left of ``item``'s turn, ranked in the engine's queue by the request
        order (as a real engine orders its own queue; under FIFO, arrival alone)."""
        job = self.seqs[item.id].job()
        if not self._ranked:
            return job
        info = QueuedRequest(item.tool_calls, item.prefix_tokens, now)
        return msgspec.structs.replace(job, rank=self.order.key(info))

    def _may_feed(self, iid: InstanceId) -> None:
        """Engine ``iid`` may have room and queued requests: look at it in the next
        :meth:`route`."""
        if iid not in self._feed and (e := self.engines.get(iid)) is not None:
            self._feed[iid] = e.order
            heapq.heappush(self._feed_heap, (e.order, iid))

    def _placement_event(self, event: ev.Event) -> None:
        """What the placement reports goes on to the controller; a request routed to
        an engine's queue marks the engine to be fed."""
        if isinstance(event, ev.ItemRouted):
            self._may_feed(event.instance)
        self.emit(event)

    def _recall(self, w: WorkerState, items: tuple[ItemId, ...], now: float) -> None:
        """The placement asks for running requests back (for a joining engine): the
        engine aborts them, keeping every token generated, as a worker would on
        ``Abort``."""
        iid = w.instance
        self._touch(iid, now)
        e = self.engines[iid]
        self._aborted(w, e.sim.abort(items), now)
        self._schedule(iid, e, now)

    def _aborted(self, w: WorkerState, aborted: Sequence[JobProgress], now: float) -> None:
        self._may_feed(w.instance)
        for a in aborted:
            self.seqs[a.id].done += a.generated_tokens
            self.totals.generated_tokens += a.generated_tokens
            result = wire.ItemResult(item=a.id, status="aborted", num_tokens=a.generated_tokens)
            self.placement.on_result(w, result, now)

    def hold(self, iid: InstanceId, now: float) -> None:
        """Route nothing more to engine ``iid``: the placement routes its queued
        requests elsewhere; those running go on until :meth:`remove`."""
        self.placement.set_active(self.engines[iid].worker, False, now)

    def remove(self, iid: InstanceId, now: float, *, failed: str | None = None) -> None:
        """Stop engine ``iid``, keeping every token it generated: the placement stops
        routing to it and routes its requests elsewhere (queued ones as they are,
        running ones aborted with their partial output); with ``failed`` (a reason), its
        worker is then reported failed (``WorkerFailed``)."""
        self._touch(iid, now)
        e = self.engines.pop(iid)
        self._feed.pop(iid, None)
        self.emit(e.sim.stats())  # its last window, which would be lost with it
        w, p = e.worker, self.placement
        p.set_active(w, False, now)
        self._aborted(w, e.sim.abort_all(), now)
        assert w.is_idle, "a drained engine holds nothing"
        if failed is None:
            p.remove_worker(w)
        else:
            p.fail_worker(w, failed, now)
        if e.busy_since is not None:
            e.busy_s += now - e.busy_since
        self.totals.rollout_device_s += e.busy_s * e.sim.config.tp
        self.totals.preemptions += e.sim.totals().num_preemptions
        self.totals.engine_tokens += e.sim.totals().generated_tokens

    def generated_tokens(self) -> int:
        """Tokens every engine, live or removed, reports having generated."""
        live = sum(e.sim.totals().generated_tokens for e in self.engines.values())
        return self.totals.engine_tokens + live

    def busy_device_s(self, now: float) -> float:
        """Device-seconds the engines have spent with requests running by ``now``."""
        live = sum(
            (e.busy_s + (now - e.busy_since if e.busy_since is not None else 0.0)) * e.sim.config.tp
            for e in self.engines.values()
        )
        return self.totals.rollout_device_s + live
