"""The rollout side of :class:`~dynarl.sim.world.SimWorld`: its modelled engines.

Requests wait in a :class:`~dynarl.sim.router.RequestRouter` until an engine has a
free slot (``max_running_requests``); multi-turn requests prefer the engine holding
their KV prefix. Each engine (a :class:`~dynarl.sim.engine.SimEngine`) advances only
when it has an event due; a turn ending in a tool call leaves the engine for the
call's latency and then returns to the router. Finished requests go to the world's
``finished`` callback, which hands them downstream.
"""

import heapq
import math
from collections.abc import Callable

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data.request_order import FifoOrder, ToolCallPriorityOrder
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.engine import SimEngine
from dynarl.sim.jobs import Job, JobDone
from dynarl.sim.metrics import WorldTotals
from dynarl.sim.progress import EngineSlot, SeqProgress
from dynarl.sim.router import RequestRouter
from dynarl.workers.config import RolloutConfig


class EngineFleet:
    """The live rollout engines, the requests waiting for them and the tool calls out.

    Args:
        graph: the controller's hypergraph, read to see the rollout instances.
        emit: where events go (``Controller.handle``).
        rollout: the engines' limits.
        request_order: the order of the queue in front of the engines (``fifo`` or
            ``priority``).
        cluster: the cost models (the engines' model).
        seqs: every request's progress, shared with the world.
        totals: the world's counters.
        finished: called with an engine and the requests it finished (their last turn).
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        rollout: RolloutConfig,
        *,
        request_order: str,
        cluster: ClusterModel,
        seqs: dict[ItemId, SeqProgress],
        totals: WorldTotals,
        finished: Callable[[InstanceId, list[SeqProgress]], None],
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.cluster = cluster
        self.seqs = seqs
        self.totals = totals
        self.finished = finished
        priority = request_order == "priority"
        self.router = RequestRouter(
            ToolCallPriorityOrder() if priority else FifoOrder(),
            aging_factor=4.0 if priority else None,
        )
        self.cap = rollout.max_running_requests
        self.engines: dict[InstanceId, EngineSlot] = {}
        self._room: dict[InstanceId, None] = {}  # active engines with a free slot
        self._eheap: list[tuple[float, InstanceId]] = []
        self._tools: list[tuple[float, int, ItemId]] = []
        self._tool_seq = 0
        self._touched: dict[InstanceId, None] = {}
        self.slowdown = 1.0  # the host's: engines' work takes this many times its alone time

    def sync(self, now: float) -> None:
        """Create modelled engines for active rollout instances that have none."""
        for node in self.graph.components[ROLLOUT].active_instances():
            if node.id not in self.engines:
                sim = SimEngine(self.cluster.engine, instance=node.id, start_s=now)
                sim.set_slowdown(self.slowdown)
                self.engines[node.id] = EngineSlot(sim)
                self._room[node.id] = None
                self._touched[node.id] = None

    def set_slowdown(self, factor: float, now: float) -> None:
        """From ``now`` on, every engine's work takes ``factor`` times its alone time
        (what is left of a running step or prefill included)."""
        self.slowdown = factor
        for iid, e in self.engines.items():
            if e.sim.next_event_time() == math.inf:
                e.sim.set_slowdown(factor)
                continue
            done = e.sim.advance_to(max(now, e.sim.now))
            if done:  # due within the clock's tolerance: handle them first
                self._completed(iid, e, done)
            e.sim.set_slowdown(factor)
            if done:
                self._schedule(iid, e, now)
            elif (t := e.sim.next_event_time()) < math.inf:
                heapq.heappush(self._eheap, (t, iid))

    def busy(self) -> list[InstanceId]:
        """The engines with a request running or prefilling."""
        return [iid for iid, e in self.engines.items() if e.busy_since is not None]

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
            _, _, item = heapq.heappop(self._tools)
            self._tool_returned(item, now)
        while self._eheap and self._eheap[0][0] <= due_s:
            t, iid = heapq.heappop(self._eheap)
            if not self._stale(t, iid):
                self._touch(iid, now)

    def report(self, now: float, *, all_engines: bool) -> None:
        """Emit the stats of the engines touched since the last report (or of all), as
        of ``now``: the controller stamps a report with its arrival time, so an engine
        whose clock lags (no event of its own since) is brought to ``now`` first."""
        if all_engines:
            self._touched.update(dict.fromkeys(self.engines))
        touched, self._touched = self._touched, {}
        for iid in touched:
            if iid in self.engines:
                if self.engines[iid].sim.now < now:
                    self._touch(iid, now)
                self.emit(self.engines[iid].sim.stats())
        self._touched.clear()

    def _touch(self, iid: InstanceId, now: float) -> None:
        """Bring engine ``iid`` to ``now`` and handle what finished meanwhile."""
        e = self.engines[iid]
        done = e.sim.advance_to(max(now, e.sim.now))
        if done:
            self._completed(iid, e, done)
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

    def _completed(self, iid: InstanceId, e: EngineSlot, done: list[JobDone]) -> None:
        finals: list[SeqProgress] = []
        for d in done:
            seq = self.seqs[d.id]
            seq.done += d.generated_tokens
            self.totals.generated_tokens += d.generated_tokens
            e.held.discard(d.id)
            seq.engine = iid
            if d.tool_call:
                self.emit(
                    ev.ToolCallStarted(
                        edge=PROMPTS, item=d.id, instance=iid, prefix_tokens=d.context_tokens
                    )
                )
                self._tool_seq += 1
                latency = seq.request.tool_latency_s[seq.turn]
                heapq.heappush(self._tools, (d.time_s + latency, self._tool_seq, d.id))
            else:
                finals.append(seq)
        if finals:
            self.finished(iid, finals)
        if self.graph.instances[iid].state == "active" and len(e.held) < self.cap:
            self._room[iid] = None

    def _tool_returned(self, item: ItemId, now: float) -> None:
        seq = self.seqs[item]
        r = seq.request
        ok, latency = r.tool_ok[seq.turn], r.tool_latency_s[seq.turn]
        seq.turn += 1
        seq.done = 0
        seq.tool_calls += 1
        self.totals.tool_calls += 1
        self.emit(ev.ToolCallFinished(edge=PROMPTS, item=item, latency_s=latency, ok=ok))
        sticky = self.engines.get(seq.engine) if seq.engine is not None else None
        prefix = sticky.sim.cached_prefix(item) if sticky is not None else 0
        node = self.graph.instances.get(seq.engine) if prefix and seq.engine else None
        engine = seq.engine if node is not None and node.state == "active" else None
        self.router.add(
            item,
            now_s=now,
            tool_calls=seq.tool_calls,
            prefix_tokens=prefix if engine else 0,
            engine=engine,
        )

    def route(self, now: float) -> None:
        """Give engines with a free slot the requests waiting for them."""
        for iid in list(self._room):
            if not self.router:
                return
            node = self.graph.instances.get(iid)
            e = self.engines.get(iid)
            if node is None or e is None or node.state != "active":
                del self._room[iid]
                continue
            jobs = []
            # Only an idle engine takes a request whose KV prefix another engine holds:
            # a busy one gains next to nothing from one more request in its batch
            # (decode is memory-bound) and would stall its batch to re-prefill it.
            while (
                len(e.held) < self.cap
                and (item := self.router.pop_for(iid, now, steal=not e.held)) is not None
            ):
                jobs.append(self._route_to(iid, e, item))
            if jobs:
                self._submit(iid, e, jobs, now)
            if len(e.held) >= self.cap:
                del self._room[iid]

    def _route_to(self, iid: InstanceId, e: EngineSlot, item: ItemId) -> Job:
        self.emit(ev.ItemRouted(edge=PROMPTS, item=item, instance=iid))
        e.held.add(item)
        return self.seqs[item].job()

    def _submit(self, iid: InstanceId, e: EngineSlot, jobs: list[Job], now: float) -> None:
        done = e.sim.advance_to(max(now, e.sim.now))
        e.sim.submit(jobs)
        if done:
            self._completed(iid, e, done)
        self._schedule(iid, e, now)

    def remove(self, iid: InstanceId, now: float) -> list[ItemId]:
        """Stop engine ``iid``, keeping every token it generated; return the requests
        it held (in id order), now unrouted."""
        self._touch(iid, now)
        e = self.engines.pop(iid)
        self.emit(e.sim.stats())  # its last window, which would be lost with it
        for p in e.sim.abort_all():
            self.seqs[p.id].done += p.generated_tokens
            self.totals.generated_tokens += p.generated_tokens
        if e.busy_since is not None:
            e.busy_s += now - e.busy_since
        self.totals.rollout_device_s += e.busy_s * self.cluster.engine.tp
        self.totals.preemptions += e.sim.totals().num_preemptions
        self.totals.engine_tokens += e.sim.totals().generated_tokens
        self._room.pop(iid, None)
        self.router.forget_engine(iid)
        return sorted(e.held)

    def assign(self, iid: InstanceId, items: list[ItemId], now: float) -> None:
        """Submit unrouted ``items`` to engine ``iid`` now (a plan's reassignment)."""
        e = self.engines[iid]
        self._submit(iid, e, [self._route_to(iid, e, item) for item in items], now)
        if len(e.held) >= self.cap:
            self._room.pop(iid, None)

    def generated_tokens(self) -> int:
        """Tokens every engine, live or removed, reports having generated."""
        live = sum(e.sim.totals().generated_tokens for e in self.engines.values())
        return self.totals.engine_tokens + live

    def busy_device_s(self, now: float) -> float:
        """Device-seconds the engines have spent with requests running by ``now``."""
        live = sum(
            e.busy_s + (now - e.busy_since if e.busy_since is not None else 0.0)
            for e in self.engines.values()
        )
        return self.totals.rollout_device_s + live * self.cluster.engine.tp
