"""The simulated cluster: modelled workers that drive, and obey, the real controller.

:class:`SimWorld` is the calibrated counterpart of :class:`dynarl.testing.world.FakeWorld`.
It plays rollout engines (:class:`~dynarl.sim.engine.SimEngine`), tool calls, inference
replicas and the trainer on the controller's clock, routes items as a data router
would, and reports only through real events. Its ``executor``
(:class:`~dynarl.sim.executor.SimExecutor`) carries out the controller's migrations.

* **Routing.** Requests wait in a :class:`~dynarl.sim.router.RequestRouter` until an
  engine has a free slot (``max_running_requests``); multi-turn requests prefer the
  engine holding their KV prefix; the order is FIFO or tool-call priority. Inference
  replicas take finished responses least-loaded first; the trainer takes a minibatch
  of whole groups once one is complete.
* **Time.** Nothing steps at a fixed ``dt``: the world sleeps (on the virtual clock)
  until the next engine event, tool return, micro-batch or optimizer-step end, or the
  next periodic stats report, and is woken early when a migration finishes.
* **Migrations.** The executor drains instances through :meth:`SimWorld.remove_engine`
  and the inference stage, and routes their work with :meth:`SimWorld.assign_rollout`
  and :meth:`SimWorld.assign_inference`; a finished migration wakes the world.

Producers report the downstream ``ItemsEnqueued`` before the upstream ``ItemCompleted``.
"""

import heapq
import math
from collections.abc import Callable

import anyio
import numpy as np

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.request_order import FifoOrder, ToolCallPriorityOrder
from dynarl.control.topology import (
    ACTOR,
    INFERENCE,
    PROMPTS,
    ROLLOUT,
    TO_ACTOR,
    TO_INFERENCE,
)
from dynarl.core.clock import Clock
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.costs import attended_context
from dynarl.sim.engine import SimEngine
from dynarl.sim.errors import SimError
from dynarl.sim.executor import SimExecutor
from dynarl.sim.jobs import Job, JobDone
from dynarl.sim.metrics import IterationRecord, WorldTotals
from dynarl.sim.progress import EngineSlot, SeqProgress
from dynarl.sim.router import RequestRouter
from dynarl.sim.stages import ActorStep, InferenceStage
from dynarl.sim.workloads import Request

_EPS = 1e-9


class SimWorld:
    """Modelled workers driven by, and reporting to, a controller.

    Args:
        graph: the controller's hypergraph, read (never changed) to see instances.
        emit: where events go (``Controller.handle``).
        clock: the controller's clock (virtual in the simulator).
        cfg: the configuration (its ``sim`` section and component sections).
        cluster: the cost models and workload (built from ``cfg`` by default).
        max_iteration_s: an iteration running longer than this (virtual seconds) is
            an error (a scheduling deadlock), reported with the pipeline's state.
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        clock: Clock,
        cfg: DynaRLConfig,
        *,
        cluster: ClusterModel | None = None,
        max_iteration_s: float = 36000.0,
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.clock = clock
        self.cfg = cfg
        self.cluster = cluster or ClusterModel.from_config(cfg)
        self.max_iteration_s = max_iteration_s
        self.rng = np.random.default_rng(cfg.run.seed)
        priority = cfg.sim.request_order == "priority"
        self.router = RequestRouter(
            ToolCallPriorityOrder() if priority else FifoOrder(),
            aging_factor=4.0 if priority else None,
        )
        self.cap = cfg.rollout.max_running_requests
        self.seqs: dict[ItemId, SeqProgress] = {}
        self.engines: dict[InstanceId, EngineSlot] = {}
        self._room: dict[InstanceId, None] = {}  # active engines with a free slot
        self._eheap: list[tuple[float, InstanceId]] = []
        self._tools: list[tuple[float, int, ItemId]] = []
        self._tool_seq = 0
        self._touched: dict[InstanceId, None] = {}
        self.inference = InferenceStage(
            self.cluster.inference, cfg.inference.micro_batch_size, self._tokens
        )
        self._inf_queue: dict[ItemId, None] = {}
        # As the real loop: a disaggregated run without inference devices trains on
        # the engines' own log-probs, so finished responses go straight to the actor.
        skip = cfg.scheduler.mode == "static-disaggregated" and not (
            INFERENCE in graph.components and graph.components[INFERENCE].instances
        )
        self._after_rollout = TO_ACTOR if skip else TO_INFERENCE
        self._group_arrived: dict[GroupId, list[ItemId]] = {}
        self._ready: list[ItemId] = []  # samples of complete groups, arrival order
        self._step: ActorStep | None = None
        self._step_ended = anyio.Event()
        self.steps_done = 0
        self._t = clock.now()
        self._next_stats_s = self._t
        self._wake = anyio.Event()
        self._dirty = True
        self.totals = WorldTotals()
        self.iterations: list[IterationRecord] = []
        self.workloads: list[tuple[Request, ...]] = []
        self.executor = SimExecutor(self)

    # ------------------------------------------------------------------ driving

    async def run(self) -> None:
        """Run ``cfg.run.num_iterations`` iterations, then return."""
        for iteration in range(self.cfg.run.num_iterations):
            await self._iteration(iteration)

    async def _iteration(self, iteration: int) -> None:
        start = self._now()
        before = self.totals.snapshot(self)
        self.steps_done = 0
        self.emit(ev.IterationStarted(iteration=iteration))
        requests = self.cluster.workload.generate(self.rng, iteration=iteration)
        self.workloads.append(requests)
        for r in requests:
            self.seqs[r.id] = SeqProgress(r)
            self.router.add(r.id, now_s=start)
        self.emit(
            ev.ItemsEnqueued(edge=PROMPTS, items=tuple(ev.ItemRef(r.id, r.group) for r in requests))
        )
        n_steps = self.cfg.algorithm.n_minibatches
        while self.steps_done < n_steps:
            self._advance()
            if self.steps_done >= n_steps:
                break
            now = self._now()
            if now - start > self.max_iteration_s:
                raise SimError(
                    f"iteration {iteration} ran past {self.max_iteration_s} s: "
                    f"{self.describe()}; a policy left a stage without devices"
                )
            wait = self._next_time() - now
            if wait > 0:
                with anyio.move_on_after(wait):
                    await self._wake.wait()
            else:
                await anyio.lowlevel.checkpoint()
            if self._wake.is_set():
                self._wake = anyio.Event()
        sync_s = self.cluster.weight_sync.time_s(self.cluster.model)
        await self.clock.sleep(sync_s)
        end = self._now()
        self.emit(ev.IterationDone(iteration=iteration))
        after = self.totals.snapshot(self)
        self.iterations.append(
            IterationRecord.between(
                iteration=iteration,
                start_s=start,
                end_s=end,
                before=before,
                after=after,
                requests=requests,
            )
        )
        for r in requests:
            del self.seqs[r.id]

    def describe(self) -> str:
        """The pipeline's state in one line (for errors)."""
        parts = [
            f"{cid}: {node.num_active_devices} devices, {self.graph.pending(cid)} pending"
            for cid, node in self.graph.components.items()
        ]
        return "; ".join(parts) + f"; free {len(self.graph.free_devices)}"

    def _now(self) -> float:
        self._t = max(self._t, self.clock.now())
        return self._t

    def _next_time(self) -> float:
        while self._eheap and self._stale(*self._eheap[0]):
            heapq.heappop(self._eheap)
        times = [self._next_stats_s, self.inference.next_time()]
        if self._eheap:
            times.append(self._eheap[0][0])
        if self._tools:
            times.append(self._tools[0][0])
        if self._step is not None:
            times.append(self._step.end_s)
        return min(times)

    def _stale(self, t: float, iid: InstanceId) -> bool:
        e = self.engines.get(iid)
        return e is None or e.sim.next_event_time() != t

    def _advance(self) -> None:
        """Process everything due by now, route, start work and report."""
        now = self._now()
        if self._dirty:
            self._sync_instances(now)
        while self._tools and self._tools[0][0] <= now + _EPS:
            _, _, item = heapq.heappop(self._tools)
            self._tool_returned(item, now)
        while self._eheap and self._eheap[0][0] <= now + _EPS:
            t, iid = heapq.heappop(self._eheap)
            if not self._stale(t, iid):
                self._touch(iid, now)
        for iid, items in self.inference.finish(now + _EPS):
            self._inference_done(iid, items)
        if self._step is not None and self._step.end_s <= now + _EPS:
            self._step_done(now)
        self._route_rollout(now)
        self._route_inference(now)
        self._start_step(now)
        if now + _EPS >= self._next_stats_s:
            self._touched.update(dict.fromkeys(self.engines))
            self._next_stats_s = now + self.cfg.sim.stats_period_s
        for iid in self._touched:
            if iid in self.engines:
                self.emit(self.engines[iid].sim.stats())
        self._touched.clear()

    def _sync_instances(self, now: float) -> None:
        """Create modelled workers for instances a migration started."""
        self._dirty = False
        for node in self.graph.components[ROLLOUT].active_instances():
            if node.id not in self.engines:
                sim = SimEngine(self.cluster.engine, instance=node.id, start_s=now)
                self.engines[node.id] = EngineSlot(sim)
                self._room[node.id] = None
                self._touched[node.id] = None
        if INFERENCE in self.graph.components:
            for node in self.graph.components[INFERENCE].active_instances():
                self.inference.add(node.id)

    # ------------------------------------------------------------------ rollout

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
            refs = tuple(ev.ItemRef(s.request.id, s.request.group) for s in finals)
            self.emit(ev.ItemsEnqueued(edge=self._after_rollout, items=refs))
            for s in finals:
                if self._after_rollout == TO_ACTOR:
                    self._arrived(s.request.id, s.request.group)
                else:
                    self._inf_queue[s.request.id] = None
                self.emit(
                    ev.ItemCompleted(
                        edge=PROMPTS,
                        item=s.request.id,
                        instance=iid,
                        num_tokens=s.request.total_output_tokens,
                    )
                )
                self.totals.requests_done += 1
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

    def _route_rollout(self, now: float) -> None:
        for iid in list(self._room):
            if not self.router:
                return
            node = self.graph.instances.get(iid)
            e = self.engines.get(iid)
            if node is None or e is None or node.state != "active":
                del self._room[iid]
                continue
            jobs = []
            while len(e.held) < self.cap and (item := self.router.pop_for(iid, now)) is not None:
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

    # ------------------------------------------------------------------ inference, actor

    def _tokens(self, item: ItemId) -> int:
        return self.seqs[item].request.total_tokens

    def _route_inference(self, now: float) -> None:
        if self._inf_queue:
            active = [
                n.id
                for n in self.graph.components[INFERENCE].active_instances()
                if n.id in self.inference.replicas
            ]
            rooms = {iid: self.inference.room(iid) for iid in active}
            for item in list(self._inf_queue):
                if not rooms:
                    break
                iid = max(rooms, key=lambda i: rooms[i])
                self.emit(ev.ItemRouted(edge=TO_INFERENCE, item=item, instance=iid))
                del self._inf_queue[item]
                self.inference.assign(iid, item)
                rooms[iid] -= 1
                if rooms[iid] <= 0:
                    del rooms[iid]
        self.inference.start(now)

    def _inference_done(self, iid: InstanceId, items: list[ItemId]) -> None:
        refs = tuple(ev.ItemRef(i, self.seqs[i].request.group) for i in items)
        self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
        for ref in refs:
            self.emit(ev.ItemCompleted(edge=TO_INFERENCE, item=ref.id, instance=iid))
            self._arrived(ref.id, ref.group)

    def _arrived(self, item: ItemId, group: GroupId) -> None:
        """``item`` is ready to train; its group joins the minibatch queue once whole."""
        members = self._group_arrived.setdefault(group, [])
        members.append(item)
        if len(members) == self.cfg.algorithm.group_size:
            self._ready.extend(members)
            del self._group_arrived[group]

    def _start_step(self, now: float) -> None:
        algo = self.cfg.algorithm
        per_step = algo.samples_per_minibatch
        if self._step is not None or len(self._ready) < per_step:
            return
        if any(ACTOR in (m.src, m.dst) for m in self.graph.migrations.values()):
            return  # the trainer is told to pause at this boundary: it is being resized
        actors = sorted(self.graph.components[ACTOR].active_instances(), key=lambda n: n.id)
        if not actors or self.steps_done >= algo.n_minibatches:
            return
        if (
            self.cluster.train_after_rollout
            and self.steps_done == 0
            and len(self._ready) < algo.samples_per_iteration
        ):
            return
        batch, self._ready = self._ready[:per_step], self._ready[per_step:]
        routed = []
        for k, item in enumerate(batch):
            node = actors[k % len(actors)]
            self.emit(ev.ItemRouted(edge=TO_ACTOR, item=item, instance=node.id))
            routed.append((item, node.id))
        devices = sum(len(n.devices) for n in actors)
        tokens = [self._tokens(i) for i in batch]
        total = len(tokens) * max(tokens) if self.cluster.padded_batches else sum(tokens)
        step_s = self.cluster.actor.step_time_s(total, devices, attended_context(tokens))
        self._step = ActorStep(routed, now, now + step_s, devices)

    def _step_done(self, now: float) -> None:
        step = self._step
        assert step is not None
        for item, iid in step.items:
            self.emit(ev.ItemCompleted(edge=TO_ACTOR, item=item, instance=iid))
        self.totals.actor_device_s += step.device_s
        self.emit(
            ev.TrainStepDone(
                component=ACTOR,
                step=self.steps_done,
                num_steps=self.cfg.algorithm.n_minibatches,
                num_samples=len(step.items),
                duration_s=step.end_s - step.start_s,
            )
        )
        self.steps_done += 1
        self._step = None
        self._step_ended.set()
        self._step_ended = anyio.Event()

    # ------------------------------------------------------------------ executor hooks

    def now(self) -> float:
        """The world's time (never behind an event it has processed)."""
        return self._now()

    async def step_boundary(self) -> None:
        """Return once no optimizer step runs (at once if none does)."""
        while self._step is not None:
            await self._step_ended.wait()

    def placement_changed(self) -> None:
        """A migration ended: create workers for new instances and wake the loop."""
        self._dirty = True
        self._wake.set()

    def remove_engine(self, iid: InstanceId, now: float) -> list[ItemId]:
        """Stop engine ``iid``, keeping every token it generated; return the requests
        it held (in id order), now unrouted."""
        self._touch(iid, now)
        e = self.engines.pop(iid)
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

    def assign_rollout(self, iid: InstanceId, items: list[ItemId], now: float) -> None:
        """Submit unrouted ``items`` to engine ``iid`` now (a plan's reassignment)."""
        e = self.engines[iid]
        self._submit(iid, e, [self._route_to(iid, e, item) for item in items], now)
        if len(e.held) >= self.cap:
            self._room.pop(iid, None)

    def requeue_inference(self, items: list[ItemId]) -> None:
        """Put a drained replica's samples back at the front of the inference queue."""
        self._inf_queue = {**dict.fromkeys(items), **self._inf_queue}

    def assign_inference(self, iid: InstanceId, item: ItemId) -> None:
        """Route queued sample ``item`` to inference replica ``iid`` (if it is queued)."""
        if item in self._inf_queue:
            del self._inf_queue[item]
            self.emit(ev.ItemRouted(edge=TO_INFERENCE, item=item, instance=iid))
            self.inference.assign(iid, item)

    def engine_generated_tokens(self) -> int:
        """Tokens every engine, live or removed, reports having generated."""
        live = sum(e.sim.totals().generated_tokens for e in self.engines.values())
        return self.totals.engine_tokens + live

    def rollout_busy_device_s(self) -> float:
        """Device-seconds rollout engines have spent with requests running so far."""
        now = self._now()
        live = sum(
            e.busy_s + (now - e.busy_since if e.busy_since is not None else 0.0)
            for e in self.engines.values()
        )
        return self.totals.rollout_device_s + live * self.cluster.engine.tp
