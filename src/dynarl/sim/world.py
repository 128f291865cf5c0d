"""The simulated cluster: modelled workers that drive, and obey, the real controller.

:class:`SimWorld` is the calibrated counterpart of :class:`dynarl.testing.world.FakeWorld`.
It plays rollout engines (:class:`~dynarl.sim.engine.SimEngine`), tool calls, inference
replicas and the trainer on the controller's clock, routes rollout requests with the
data plane's own placement, and reports only through real events. Its ``fleet``
(:class:`~dynarl.sim.fleet.EngineFleet`) runs the rollout engines and tool calls, its
``actor`` (:class:`~dynarl.sim.actor.SimActor`) assembles groups and runs optimizer
steps, and its ``executor`` (:class:`~dynarl.sim.executor.SimExecutor`) carries out the
controller's migrations.

* **Routing.** Requests are routed by the data router's
  :class:`~dynarl.data.placement.Placement` (see :mod:`dynarl.sim.fleet`): each engine
  has a request queue (FIFO or tool-call priority) and runs up to
  ``max_running_requests`` of it; multi-turn requests prefer the engine holding their
  KV prefix; an engine with room takes requests waiting at others. Finished responses
  go to the inference replicas through a placement of their own edge in the same way
  (see :mod:`dynarl.sim.inference`: a replica runs one micro-batch at a time and takes
  samples waiting at others when it has room); the trainer takes a minibatch of whole
  groups once one is complete.
* **Time.** Nothing steps at a fixed ``dt``: the world sleeps (on the virtual clock)
  until the next engine event, tool return, micro-batch or optimizer-step end, or the
  next periodic stats report, and is woken early when a migration finishes.
* **Shared hosts.** Where the cluster's slots share a host's cores (a CPU profile with
  a measured :class:`~dynarl.sim.host.HostSharing` curve), every worker runs at the
  speed the number of busy slots allows, the controller process counted as a
  fractional one at its measured CPU per response and per token while the engines
  decode, reset at every event that changes them; devices are otherwise independent.
* **Migrations.** The executor drains instances through :meth:`SimWorld.remove_engine`
  and :meth:`SimWorld.remove_replica` (the placements route a drained worker's items
  elsewhere, to where the plan's ``reassign`` says if it can, as the data router
  does); a finished migration wakes the world.

Producers report the downstream ``ItemsEnqueued`` before the upstream ``ItemCompleted``.
"""

from collections.abc import Callable, Iterable, Sequence

import anyio
import msgspec
import numpy as np

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import MigrationKind
from dynarl.control.topology import INFERENCE, TO_ACTOR, TO_INFERENCE
from dynarl.core.clock import Clock
from dynarl.core.ids import ComponentKind, GroupId, InstanceId, ItemId
from dynarl.data.peers import RouterConfig, with_balance
from dynarl.obs.trace_records import Request
from dynarl.sim.actor import SimActor
from dynarl.sim.alarm import Alarm
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimulatedRun
from dynarl.sim.errors import SimError
from dynarl.sim.executor import SimExecutor
from dynarl.sim.fleet import EngineFleet
from dynarl.sim.inference import InferenceFleet
from dynarl.sim.metrics import IterationRecord, WorldTotals
from dynarl.sim.partial import PartialRollouts
from dynarl.sim.progress import SeqProgress
from dynarl.sim.stages import InferenceStage

_EPS = 1e-9


class SimWorld:
    """Modelled workers driven by, and reporting to, a controller.

    Args:
        graph: the controller's hypergraph, read (never changed) to see instances.
        emit: where events go (``Controller.handle``).
        clock: the controller's clock (virtual in the simulator).
        run: the simulated run (its job and the modelled cluster).
        cluster: the cost models and workload (built from ``run`` by default).
        max_iteration_s: an iteration running longer than this (virtual seconds) is
            an error (a scheduling deadlock), reported with the pipeline's state.
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        clock: Clock,
        run: SimulatedRun,
        *,
        cluster: ClusterModel | None = None,
        max_iteration_s: float = 36000.0,
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.clock = clock
        self.run_config = run
        cfg = self.cfg = run.job
        self.cluster = cluster or build_cluster(run)
        self.max_iteration_s = max_iteration_s
        self.rng = np.random.default_rng(cfg.run.seed)
        self.seqs: dict[ItemId, SeqProgress] = {}
        router = with_balance(RouterConfig(), cfg.rollout.balance)
        self.inference = InferenceFleet(
            graph,
            emit,
            clock,
            InferenceStage(self.cluster.inference, cfg.inference.micro_batch_size, self._tokens),
            seed=cfg.run.seed,
            router=router,
        )
        # As the real loop: without an inference stage the actor trains on the
        # engines' own log-probs, so finished responses go straight to it.
        self._after_rollout = TO_INFERENCE if INFERENCE in graph.components else TO_ACTOR
        self._t = clock.now()
        self._next_stats_s = self._t
        self._wake = Alarm()
        self._dirty = True
        self.totals = WorldTotals()
        self.fleet = EngineFleet(
            graph,
            emit,
            clock,
            cfg.rollout,
            request_order=run.sim.request_order,
            seed=cfg.run.seed,
            cluster=self.cluster,
            seqs=self.seqs,
            totals=self.totals,
            finished=self._rollout_done,
            router=router,
        )
        self.engines = self.fleet.engines
        self.actor = SimActor(
            graph,
            emit,
            cfg.algorithm,
            cluster=self.cluster,
            tokens=self._tokens,
            totals=self.totals,
        )
        self.iterations: list[IterationRecord] = []
        self.workloads: list[tuple[Request, ...]] = []
        """Each iteration's trained requests (with partial rollouts, those of the
        groups it admitted, some begun in earlier iterations)."""
        self.partial = PartialRollouts(cfg.algorithm) if cfg.algorithm.partial_rollouts else None
        self.executor = SimExecutor(self)
        self.slowdown = 1.0  # the host's, shared by every worker (see share_host)

    # ------------------------------------------------------------------ driving

    async def run(self) -> None:
        """Run ``cfg.run.num_iterations`` iterations, then return."""
        for iteration in range(self.cfg.run.num_iterations):
            await self._iteration(iteration)

    async def _iteration(self, iteration: int) -> None:
        start = self._now()
        before = self._snapshot()
        requests = self.cluster.workload.generate(self.rng, iteration=iteration)
        ready: list[SeqProgress] = []
        if self.partial is None:
            self.emit(ev.IterationStarted(iteration=iteration))
            seqs = [SeqProgress(r) for r in requests]
            self.actor.begin_iteration(iteration, [r.id for r in requests], self.cfg.run.seed)
        else:
            fresh = _first_groups(requests, self.partial.fresh_groups_needed())
            seqs, ready = self.partial.begin(fresh)
            self.emit(
                ev.IterationStarted(
                    iteration=iteration,
                    groups_to_complete=self.partial.groups_to_complete,
                    groups_due=self.partial.groups_due,
                    group_size=self.cfg.algorithm.group_size,
                )
            )
            self.actor.begin_iteration(iteration, None, self.cfg.run.seed)
        for seq in seqs:
            self.seqs[seq.request.id] = seq
        if self._dirty:  # the engines join before the batch arrives, as real workers do
            self._sync_instances(start)
        self.fleet.admit(seqs, start)
        if ready:
            self._downstream(ready)
        n_steps = self.cfg.algorithm.n_minibatches
        while self.actor.steps_done < n_steps:
            self._advance()
            if self.actor.steps_done >= n_steps:
                break
            now = self._now()
            if now - start > self.max_iteration_s:
                raise SimError(
                    f"iteration {iteration} ran past {self.max_iteration_s} s: "
                    f"{self.describe()}; a policy left a stage without devices"
                )
            wait = self._next_time() - now
            if wait > 0:
                await self._wake.wait(wait)
            else:
                await anyio.lowlevel.checkpoint()
            self._wake.clear()
        sync_s = self.cluster.weight_sync.time_s(self.cluster.model)
        await self.clock.sleep(sync_s)
        end = self._now()
        self.emit(ev.IterationDone(iteration=iteration))
        after = self._snapshot()
        record = IterationRecord.between(
            iteration=iteration,
            start_s=start,
            end_s=end,
            before=before,
            after=after,
            requests=requests,
        )
        if self.partial is not None:
            carried = self.partial.num_carried_groups
            trained, older_tokens, most_carried = self.partial.end()
            requests = tuple(trained)
            record = msgspec.structs.replace(
                record,
                num_sequences=len(requests),
                carried_groups=carried,
                older_tokens=older_tokens,
                trained_tokens=sum(r.total_output_tokens for r in requests),
                max_times_carried=most_carried,
            )
        self.workloads.append(requests)
        self.iterations.append(record)
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
        return min(
            self._next_stats_s,
            self.inference.next_time(),
            self.actor.next_time(),
            self.fleet.next_time(),
        )

    def _advance(self) -> None:
        """Process everything due by now, route, start work and report."""
        now = self._now()
        if self._dirty:
            self._sync_instances(now)
        self.fleet.advance(now, now + _EPS)
        if self.partial is not None and self.partial.rollout_over and self.fleet.placement.pending:
            self.fleet.withdraw_pending(now)  # the groups it trains are whole: the rest carry over
        for iid, items in self.inference.stage.finish(now + _EPS):
            self._inference_done(iid, items, now)
        self.actor.finish(now + _EPS)
        self.fleet.route(now)
        self.inference.route(now)
        self.actor.start(now)
        self._share_host(now)
        report_all = now + _EPS >= self._next_stats_s
        if report_all:
            self._next_stats_s = now + self.run_config.sim.stats_period_s
        self.fleet.report(now, all_engines=report_all)

    def _snapshot(self) -> dict[str, float]:
        return self.totals.snapshot(
            busy_rollout=self.rollout_busy_device_s(),
            busy_inference=self.inference.busy_device_s,
        )

    def _sync_instances(self, now: float) -> None:
        """Create modelled workers for instances a migration started."""
        self._dirty = False
        self.fleet.sync(now)
        self.inference.sync(now)

    def _share_host(self, now: float) -> bool:
        """Set every worker's speed from the number of busy slots and the controller
        process's share of a core (a cluster whose slots share a host's cores,
        :class:`~dynarl.sim.host.HostSharing`); return whether it changed."""
        host = self.cluster.host
        if host is None:
            return False
        slots = (
            self.fleet.busy_devices()
            + len(self.inference.busy()) * self.cluster.inference.tp
            + self.actor.busy_devices()
        )
        factor = host.factor(slots)
        if host.counts_controller:
            # The controller process, a fractional tenant at its measured CPU per token
            # and per response times the engines' rates (at the slots' speed, without
            # its own share).
            tokens, responses = self.fleet.decode_rates_alone()
            factor = host.factor(slots + host.controller_load(tokens / factor, responses / factor))
        if factor == self.slowdown:
            return False
        self.slowdown = factor
        self.fleet.set_slowdown(factor, now)
        self.inference.set_slowdown(factor, now)
        self.actor.set_slowdown(factor, now)
        return True

    # ------------------------------------------------------------------ downstream

    def _rollout_done(self, iid: InstanceId, finals: list[SeqProgress]) -> None:
        """Engine ``iid`` finished ``finals``: hand them to inference (or the actor),
        with partial rollouts once their group is admitted; the placement then reports
        them completed."""
        self.totals.requests_done += len(finals)
        if self.partial is not None:
            finals = self.partial.finished(finals)
        if finals:
            self._downstream(finals)

    def _downstream(self, finals: list[SeqProgress]) -> None:
        """Finished samples to inference (or the actor)."""
        refs = tuple(
            ev.ItemRef(s.request.id, s.request.group, s.request.total_tokens) for s in finals
        )
        if self._after_rollout == TO_INFERENCE:
            self.inference.admit(refs, self._now())
            return
        self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
        for s in finals:
            self.actor.arrived(s.request.id, s.request.group)

    def _tokens(self, item: ItemId) -> int:
        return self.seqs[item].request.total_tokens

    def _inference_done(self, iid: InstanceId, items: list[ItemId], now: float) -> None:
        """Replica ``iid`` scored ``items``: hand them to the actor; the inference
        placement then reports them completed."""
        refs = tuple(ev.ItemRef(i, self.seqs[i].request.group, self._tokens(i)) for i in items)
        self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
        self.inference.completed(iid, items, now)
        for ref in refs:
            self.actor.arrived(ref.id, ref.group)

    # ------------------------------------------------------------------ executor hooks

    def now(self) -> float:
        """The world's time (never behind an event it has processed)."""
        return self._now()

    def share_host(self, now: float) -> None:
        """Workers started or stopped outside the world's loop (a migration drained
        them): reset the host's sharing and wake the loop if the speed changed."""
        if self._share_host(now):
            self._wake.set()

    async def step_boundary(self) -> None:
        """Return once no optimizer step runs (at once if none does)."""
        await self.actor.step_boundary()

    def placement_changed(self) -> None:
        """A migration ended: create workers for new instances and wake the loop."""
        self._dirty = True
        self._wake.set()

    def plan_moves(self, reassign: Iterable[tuple[ItemId, InstanceId]]) -> None:
        """A migration's plan of where the drained instances' items go when next routed
        (each placement takes those it routes)."""
        moves = list(reassign)
        self.fleet.placement.plan((item, dst) for item, dst in moves if dst in self.engines)
        self.inference.plan(moves)

    def release(self, iids: Iterable[InstanceId], now: float) -> None:
        """Stop the engines and inference replicas of ``iids`` a migration drains; the
        items they held are routed elsewhere, as planned where the target can take
        them."""
        for iid in iids:
            if iid in self.engines:
                self.remove_engine(iid, now)
            elif iid in self.inference.workers:
                self.remove_replica(iid, now)
        self.share_host(now)

    def charge_migration(
        self, kind: MigrationKind, src: ComponentKind | None, dst: ComponentKind | None
    ) -> float:
        """A move's time on the cluster's cost model, counted in :attr:`totals`."""
        cost = self.cluster.migration.move_time_s(kind, src, dst, self.cluster.model)
        self.totals.migration_s += cost
        return cost

    def hold_workers(self, iids: Iterable[InstanceId], now: float) -> None:
        """Route nothing more to those of ``iids`` that are engines or inference
        replicas (a migration drains them); their queued items go elsewhere, their
        running ones go on until they are removed."""
        for iid in iids:
            if iid in self.engines:
                self.fleet.hold(iid, now)
            elif iid in self.inference.workers:
                self.inference.hold(iid, now)

    def remove_engine(self, iid: InstanceId, now: float, *, failed: str | None = None) -> None:
        """Stop engine ``iid``, keeping every token it generated; the placement routes
        the requests it held elsewhere (see :meth:`EngineFleet.remove`)."""
        self.fleet.remove(iid, now, failed=failed)

    def remove_replica(
        self, iid: InstanceId, now: float, *, failed: str | None = None
    ) -> list[ItemId]:
        """Stop inference replica ``iid`` (its running micro-batch is lost); the
        placement routes the samples it held elsewhere (see
        :meth:`InferenceFleet.remove`), which are returned."""
        return self.inference.remove(iid, now, failed=failed)

    def engine_generated_tokens(self) -> int:
        """Tokens every engine, live or removed, reports having generated."""
        return self.fleet.generated_tokens()

    def rollout_busy_device_s(self) -> float:
        """Device-seconds rollout engines have spent with requests running so far."""
        return self.fleet.busy_device_s(self._now())


def _first_groups(requests: Sequence[Request], num_groups: int) -> list[Request]:
    """The requests of the first ``num_groups`` groups (a group's samples are adjacent)."""
    seen: set[GroupId] = set()
    out = []
    for r in requests:
        if r.group not in seen:
            if len(seen) == num_groups:
                break
            seen.add(r.group)
        out.append(r)
    return out
