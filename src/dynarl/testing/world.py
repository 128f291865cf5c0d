"""A small in-process pipeline world for tests, demos and benchmarks of the controller.

:class:`FakeWorld` plays rollout engines, inference replicas and a data-parallel
actor with simple cost models on the controller's clock, and talks to the controller
only through real events (``ItemsEnqueued``, ``ItemRouted``, ``EngineStats``,
``ItemCompleted``, ``TrainStepDone``, ...). It is also the controller's
:class:`~dynarl.control.controller.Executor`: a migration pauses the drained instances,
aborts their requests (keeping the tokens generated so far), re-routes them as the plan
says, and takes a configurable time. Run it on a
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
from dynarl.core.ids import EdgeId, GroupId, InstanceId, ItemId


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
    __slots__ = ("done", "target")

    def __init__(self, target: int) -> None:
        self.target = target
        self.done = 0.0


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
        refs = []
        for p in range(cfg.num_prompts):
            group = GroupId(f"{iteration}/{p}")
            mu = math.log(cfg.median_tokens) + cfg.sigma * self.rng.standard_normal()
            for s in range(cfg.group_size):
                item = ItemId(f"{iteration}/{p}/{s}")
                length = math.exp(mu + cfg.group_sigma * self.rng.standard_normal())
                self.requests[item] = _Request(max(1, min(cfg.max_tokens, round(length))))
                refs.append(ev.ItemRef(item, group))
        self.emit(ev.ItemsEnqueued(edge=PROMPTS, items=tuple(refs)))

    def _active(self, component: str) -> list[Node]:
        node = self.graph.components.get(component)  # type: ignore[call-overload]
        return [] if node is None else sorted(node.active_instances(), key=lambda n: n.id)

    def _route(self, edge_id: EdgeId, limit: int | None = None) -> None:
        """Send queued items to the least-loaded active consumer instances."""
        edge = self.graph.edges[edge_id]
        targets = [n for c in edge.spec.consumers for n in self._active(c)]
        if not targets or not edge.queue:
            return
        cap = limit if limit is not None else math.inf
        for item in list(edge.queue):
            target = min(targets, key=lambda n: (len(n.items), n.id))
            if len(target.items) >= cap:
                break
            self.emit(ev.ItemRouted(edge=edge_id, item=item, instance=target.id))

    def _advance(self, dt: float) -> None:
        self._route(PROMPTS, limit=self.cfg.max_running)
        self._advance_rollout(dt)
        self._route(TO_INFERENCE)
        self._advance_inference(dt)
        self._advance_actor()

    def _advance_rollout(self, dt: float) -> None:
        cfg = self.cfg
        # A draining engine keeps decoding until its migration aborts its requests.
        engines = sorted(self.graph.components[ROLLOUT].instances.values(), key=lambda n: n.id)
        for node in engines:
            running = [i for i in node.items if i in self.requests]
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
                        self._finish_rollout(item, node.id, req)
            self.tokens_generated += round(generated)
            held = sum(r.done + 64 for i in node.items if (r := self.requests.get(i)))
            self.emit(
                ev.EngineStats(
                    instance=node.id,
                    kv_usage=min(1.0, held / cfg.kv_capacity_tokens),
                    num_running=len(node.items),
                    num_queued=0,
                    gen_tokens_per_s=generated / dt,
                    kv_tokens=round(held),
                )
            )

    def _finish_rollout(self, item: ItemId, instance: InstanceId, req: _Request) -> None:
        group = self.graph.edges[PROMPTS].items[item].group
        del self.requests[item]
        # Downstream first, so the work never seems to vanish between two events.
        self.emit(ev.ItemsEnqueued(edge=TO_INFERENCE, items=(ev.ItemRef(item, group),)))
        self.emit(
            ev.ItemCompleted(edge=PROMPTS, item=item, instance=instance, num_tokens=req.target)
        )

    def _advance_inference(self, dt: float) -> None:
        for node in self._active(INFERENCE):
            if not node.items:
                self.credit[node.id] = 0.0
                continue
            credit = self.credit.get(node.id, 0.0) + dt * self.cfg.inference_items_per_s * len(
                node.devices
            )
            for item in list(node.items)[: int(credit)]:
                group = self.graph.edges[TO_INFERENCE].items[item].group
                self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(item, group),)))
                self.emit(ev.ItemCompleted(edge=TO_INFERENCE, item=item, instance=node.id))
                credit -= 1
            self.credit[node.id] = credit

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
        """Carry out a migration: abort and re-route the drained instances' items
        (keeping their progress), wait out the cost, then report."""
        if migration.kind == "reshard":
            # The trainer moves only at optimizer-step boundaries; the drained
            # instances keep working until then.
            while self.actor_busy_until is not None:
                await self.clock.sleep(self.cfg.dt_s)
        by_edge: dict[EdgeId, list[ItemId]] = {}
        for iid in migration.drain:
            node = self.graph.instances.get(iid)
            if node is not None:
                for item, edge in node.items.items():
                    by_edge.setdefault(edge, []).append(item)
        for edge, items in by_edge.items():
            self.emit(ev.ItemsRequeued(edge=edge, items=tuple(items)))
        for item, target in migration.reassign:
            node = self.graph.instances.get(target)
            st = self.graph.edges[PROMPTS].items.get(item)
            if node is not None and node.state == "active" and st is not None and st.owner is None:
                self.emit(ev.ItemRouted(edge=PROMPTS, item=item, instance=target))
        await self.clock.sleep(self.cfg.migration_s.get(migration.kind, 1.0))
        if self.fail(migration):
            raise MigrationError(f"migration {migration.id} told to fail")
