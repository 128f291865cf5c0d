"""A small in-process pipeline world for tests, demos and benchmarks of the controller.

:class:`FakeWorld` plays rollout engines, inference replicas and a data-parallel
actor with simple cost models on the controller's clock, and talks to the controller
only through real events (``ItemsEnqueued``, ``ItemRouted``, ``EngineStats``,
``ItemCompleted``, ``TrainStepDone``, ...). Requests and samples are routed by the data
router's own :class:`~dynarl.data.placement.Placement` (each engine and replica a
:class:`~dynarl.data.peers.WorkerState` of capacity ``max_running`` with the real
request queue in front of it, the :class:`~dynarl.data.routing.AffinityRouting` policy
seeded with ``seed``; an instance with room takes items waiting at others), which
reports every routing event. It is also the controller's
:class:`~dynarl.control.controller.Executor`: a migration stops routing to the drained
instances, aborts their items (keeping the tokens generated so far) and has the
placement route them as the plan says, and takes a configurable time. Run it on a
:class:`~dynarl.core.virtual_time.VirtualTimeLoop` and an iteration of minutes takes
milliseconds.

Cost models: a decode step of an engine takes ``step_s + per_seq_s * running`` and
adds one token to every running request (so a near-empty engine wastes its device —
the long tail); inference and training process ``items_per_s`` per device.
Response lengths are lognormal per group (samples of one prompt have similar lengths),
capped at ``max_tokens``.
"""

import math
from collections.abc import Callable

import msgspec
import numpy as np

from dynarl.control import events as ev
from dynarl.control.elements import Node
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import Migration
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT, TO_ACTOR, TO_INFERENCE
from dynarl.core.clock import Clock
from dynarl.core.errors import DynaRLError
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import order_named
from dynarl.data.routing import AffinityRouting
from dynarl.data.transport import PeerId


class MigrationError(DynaRLError):
    """A fake migration was told to fail."""


class FakeWorldConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Cost models and workload of a :class:`FakeWorld`."""

    num_prompts: int = 16
    group_size: int = 4
    n_minibatches: int = 2
    num_iterations: int = 1
    median_tokens: float = 64.0
    sigma: float = 1.0
    group_sigma: float = 0.2
    max_tokens: int = 1024
    step_s: float = 0.02
    per_seq_s: float = 0.0005
    max_running: int = 64
    kv_capacity_tokens: int = 65536
    inference_items_per_s: float = 100.0
    actor_items_per_s: float = 40.0
    dt_s: float = 0.05
    max_iteration_s: float = 36000.0
    migration_s: dict[str, float] = msgspec.field(
        default_factory=lambda: {"workload": 0.5, "reshard": 0.3, "reboot": 2.0}
    )
    seed: int = 0


class _Request:
    __slots__ = ("done", "reported", "target")

    def __init__(self, target: int) -> None:
        self.target = target
        self.done = 0.0
        self.reported = 0  # tokens already reported in a result (aborted turns)

    def report(self, upto: int) -> int:
        """Tokens generated since the last result, up to ``upto`` in all."""
        n, self.reported = upto - self.reported, upto
        return n


class FakeWorld:
    """Modelled workers driven by, and reporting to, a controller.

    Args:
        graph: the controller's hypergraph, read (never changed) to see instances.
        emit: where events go (``Controller.handle``).
        clock: the controller's clock.
        cfg: workload and cost models.
        fail: migrations for which this returns ``True`` fail after their cost.
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        clock: Clock,
        cfg: FakeWorldConfig,
        *,
        fail: Callable[[Migration], bool] = lambda m: False,
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.clock = clock
        self.cfg = cfg
        self.fail = fail
        self.rng = np.random.default_rng(cfg.seed)
        self.router = RouterConfig()
        self.placement = Placement(
            {PROMPTS: (ROLLOUT,), TO_INFERENCE: (INFERENCE,)},
            policy=AffinityRouting(seed=cfg.seed),
            emit=emit,
            balance_on_join=self.router.balance_on_join,
            balance_below_share=self.router.balance_below_share,
            recall=self._recall,
        )
        self.workers: dict[InstanceId, WorkerState] = {}
        self.requests: dict[ItemId, _Request] = {}
        self.credit: dict[InstanceId, float] = {}
        self.actor_busy_until: float | None = None
        self.actor_batch: list[ItemId] = []
        self.steps_done = 0
        self.iteration_times_s: list[float] = []
        self.tokens_generated = 0

    # ------------------------------------------------------------------ driving

    async def run(self) -> None:
        """Run the configured iterations, then return."""
        for iteration in range(self.cfg.num_iterations):
            start = self.clock.now()
            self._start_iteration(iteration)
            while self.steps_done < self.cfg.n_minibatches:
                await self.clock.sleep(self.cfg.dt_s)
                self._advance(self.cfg.dt_s)
                if self.clock.now() - start > self.cfg.max_iteration_s:
                    raise DynaRLError(
                        f"iteration {iteration} made no progress for {self.cfg.max_iteration_s}"
                        f" s: {self._describe()}"
                    )
            self.emit(ev.IterationDone(iteration=iteration))
            self.iteration_times_s.append(self.clock.now() - start)

    def _describe(self) -> str:
        parts = []
        for cid, node in self.graph.components.items():
            parts.append(
                f"{cid}: {node.num_active_devices} devices, {self.graph.pending(cid)} pending"
            )
        return "; ".join(parts) + f"; free {sorted(self.graph.free_devices)}"

    def _start_iteration(self, iteration: int) -> None:
        cfg = self.cfg
        self.emit(ev.IterationStarted(iteration=iteration))
        self.steps_done = 0
        items = []
        for p in range(cfg.num_prompts):
            group = GroupId(f"{iteration}/{p}")
            mu = math.log(cfg.median_tokens) + cfg.sigma * self.rng.standard_normal()
            for s in range(cfg.group_size):
                item = ItemId(f"{iteration}/{p}/{s}")
                length = math.exp(mu + cfg.group_sigma * self.rng.standard_normal())
                self.requests[item] = _Request(max(1, min(cfg.max_tokens, round(length))))
                items.append(wire.Item(id=item, group=group, edge=PROMPTS))
        self._sync_workers()  # workers join before the batch arrives, as real ones do
        self.placement.admit(items, self.clock.now())

    def _active(self, component: str) -> list[Node]:
        node = self.graph.components.get(component)  # type: ignore[call-overload]
        return [] if node is None else sorted(node.active_instances(), key=lambda n: n.id)

    def _sync_workers(self) -> None:
        """Workers for active engines and replicas that have none (a migration made
        them, or a failed one gave them back) join the placement."""
        now = self.clock.now()
        for component in (ROLLOUT, INFERENCE):
            for node in self._active(component):
                if node.id in self.workers:
                    continue
                w = WorkerState.configured(
                    PeerId(node.id.encode()),
                    instance=node.id,
                    component=node.component,
                    capacity=self._capacity(node),
                    config=self.router,
                    order=order_named("fifo"),
                    clock=self.clock,
                    now_s=now,
                )
                self.workers[node.id] = w
                self.placement.add_worker(w, now)

    def _capacity(self, node: Node) -> int:
        """What a worker serves at once: an engine ``max_running`` requests, a replica
        the samples it scores in one ``dt_s`` (the rest wait in its queue, where a
        replica with room can take them)."""
        if node.component == ROLLOUT:
            return self.cfg.max_running
        return max(1, math.ceil(self.cfg.inference_items_per_s * len(node.devices) * self.cfg.dt_s))

    def _recall(self, w: WorkerState, items: tuple[ItemId, ...], now: float) -> None:
        """Hand running requests back for a joining engine, keeping their progress (as
        a rollout worker does on ``Abort``); a replica scores what it started."""
        if w.component != ROLLOUT:
            return
        for item in items:
            if item in w.in_flight:
                self._abort(w, item, now)

    def _abort(self, w: WorkerState, item: ItemId, now: float) -> None:
        req = self.requests.get(item)
        tokens = 0 if req is None else req.report(math.floor(req.done))
        result = wire.ItemResult(item=item, status="aborted", num_tokens=tokens)
        self.placement.on_result(w, result, now)

    def _feed(self) -> None:
        """Each worker takes from its queue up to its capacity (a worker link's pump)."""
        if self.placement.backlog:
            self.placement.refill(self.clock.now())
        for w in self.workers.values():
            room = w.capacity - len(w.in_flight)
            if room > 0 and len(w.queue):
                for item in w.queue.get_batch_nowait(room):
                    w.in_flight.add(item)

    def _workers(self, component: str) -> list[WorkerState]:
        """The component's workers, draining ones included, in instance order."""
        return sorted(
            (w for w in self.workers.values() if w.component == component),
            key=lambda w: w.instance,
        )

    def _advance(self, dt: float) -> None:
        self._sync_workers()
        self._feed()
        self._advance_rollout(dt)
        self._advance_inference(dt)
        self._feed()
        self._advance_actor()

    def _advance_rollout(self, dt: float) -> None:
        cfg = self.cfg
        now = self.clock.now()
        # A draining engine keeps decoding until its migration aborts its requests.
        for w in self._workers(ROLLOUT):
            running = list(w.in_flight)
            generated = 0.0
            if running:
                step = cfg.step_s + cfg.per_seq_s * len(running)
                tokens = dt / step
                for item in running:
                    req = self.requests[item]
                    before = req.done
                    req.done = min(req.target, req.done + tokens)
                    generated += req.done - before
                    if req.done >= req.target:
                        self._finish_rollout(w, item, req, now)
                self.placement.after_results(w, now)
            self.tokens_generated += round(generated)
            held = sum(self.requests[i].done + 64 for i in w.in_flight)
            self.emit(
                ev.EngineStats(
                    instance=w.instance,
                    kv_usage=min(1.0, held / cfg.kv_capacity_tokens),
                    num_running=len(w.in_flight),
                    num_queued=len(w.queue),
                    gen_tokens_per_s=generated / dt,
                    kv_tokens=round(held),
                )
            )

    def _finish_rollout(self, w: WorkerState, item: ItemId, req: _Request, now: float) -> None:
        group = w.in_flight[item].group
        del self.requests[item]
        # Downstream first, so the work never seems to vanish between two events.
        self.placement.admit([wire.Item(id=item, group=group, edge=TO_INFERENCE)], now)
        result = wire.ItemResult(item=item, num_tokens=req.report(req.target))
        self.placement.on_result(w, result, now)

    def _advance_inference(self, dt: float) -> None:
        now = self.clock.now()
        for w in self._workers(INFERENCE):
            if not w.active:
                continue  # held by a migration: it computes nothing more
            if not w.in_flight:
                self.credit[w.instance] = 0.0
                continue
            devices = len(self.graph.instances[w.instance].devices)
            credit = (
                self.credit.get(w.instance, 0.0) + dt * self.cfg.inference_items_per_s * devices
            )
            for item in list(w.in_flight.values())[: int(credit)]:
                self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(item.id, item.group),)))
                self.placement.on_result(w, wire.ItemResult(item=item.id), now)
                credit -= 1
            self.credit[w.instance] = credit
            self.placement.after_results(w, now)

    def _advance_actor(self) -> None:
        cfg = self.cfg
        now = self.clock.now()
        if self.actor_busy_until is not None:
            if now < self.actor_busy_until:
                return
            self._finish_step(now)
        edge = self.graph.edges[TO_ACTOR]
        per_step = cfg.num_prompts * cfg.group_size // cfg.n_minibatches
        actors = self._active(ACTOR)
        if self.steps_done >= cfg.n_minibatches or not actors or len(edge.queue) < per_step:
            return
        if self.graph.components[ACTOR].hold_steps:
            return  # the controller holds it: devices are on their way to it
        batch = list(edge.queue)[:per_step]
        for k, item in enumerate(batch):
            node = actors[k % len(actors)]
            self.emit(ev.ItemRouted(edge=TO_ACTOR, item=item, instance=node.id))
        devices = sum(len(n.devices) for n in actors)
        self.actor_batch = batch
        self.actor_busy_until = now + per_step / (cfg.actor_items_per_s * devices)
        self._step_started = now

    def _finish_step(self, now: float) -> None:
        edge = self.graph.edges[TO_ACTOR]
        for item in self.actor_batch:
            owner = edge.items[item].owner
            assert owner is not None
            self.emit(ev.ItemCompleted(edge=TO_ACTOR, item=item, instance=owner))
        self.emit(
            ev.TrainStepDone(
                component=ACTOR,
                step=self.steps_done,
                num_steps=self.cfg.n_minibatches,
                num_samples=len(self.actor_batch),
                duration_s=now - self._step_started,
            )
        )
        self.steps_done += 1
        self.actor_batch = []
        self.actor_busy_until = None

    # ------------------------------------------------------------------ executor

    async def execute(self, migration: Migration) -> None:
        """Carry out a migration: stop routing to the drained instances (their queued
        items go elsewhere), abort their items in flight (keeping their progress) for
        the placement to route as the plan says, wait out the cost, then report."""
        now = self.clock.now()
        self.placement.plan(migration.reassign)
        drained = [self.workers[i] for i in migration.drain if i in self.workers]
        for w in drained:
            self.placement.set_active(w, False, now)
        if migration.kind == "reshard":
            # The trainer moves only at optimizer-step boundaries; the drained
            # instances keep working until then.
            while self.actor_busy_until is not None:
                await self.clock.sleep(self.cfg.dt_s)
        now = self.clock.now()
        for w in drained:
            for item in list(w.in_flight):
                self._abort(w, item, now)
            self.placement.remove_worker(w)
            del self.workers[w.instance]
        await self.clock.sleep(self.cfg.migration_s.get(migration.kind, 1.0))
        if self.fail(migration):
            raise MigrationError(f"migration {migration.id} told to fail")
