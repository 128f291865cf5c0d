"""The controller: one event loop that keeps the hypergraph current and acts on it.

Events arrive from an event source (an anyio object stream fed by the data plane, the
simulator or test fakes); each is applied to the hypergraph, may fire a trigger, and a
trigger asks the policy for a plan. Committed migrations are recorded in the
hypergraph as ``MigrationStarted`` and carried out by the :class:`Executor` in tasks of
the controller's task group; their outcome comes back as ``MigrationDone`` or
``MigrationFailed``. A periodic tick (on the injected clock) fires the ``tick``
trigger and feeds the predictor. Nothing here reads the wall clock except to measure
how long decisions take, so the same controller runs on a virtual clock.
"""

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Protocol

import anyio
import msgspec
from anyio.abc import ObjectReceiveStream, TaskGroup, TaskStatus

from dynarl.control import events as ev
from dynarl.control.decode_window import DecodeWindows, active_context, counts_steps
from dynarl.control.elements import HyperNode
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import Migration, Plan
from dynarl.control.predictor import Predictor
from dynarl.control.reprefill import reprefill_span_s
from dynarl.control.scheduler import Policy, StepHold, Trigger, TriggerKind
from dynarl.core.clock import Clock
from dynarl.core.errors import EventError, in_words
from dynarl.core.ids import ComponentId

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Carries out migrations in some world (real workers, the simulator, fakes)."""

    async def execute(self, migration: Migration) -> float | None:
        """Carry out ``migration``; return once the new instances are active.

        May return the seconds it waited before the move began (a trainer is resized
        only at an optimizer-step boundary): that wait is not the move's cost, and is
        left out of the cost the predictor learns.

        Raise to report failure; the drained instances must then still be running
        where they were (create-before-destroy).
        """
        ...


class CommittedPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A plan the controller committed, with what its policy predicted of it: the
    seconds until the iteration's work is done with the plan (``predicted_s``) and
    without it (``predicted_without_s``); both 0 for a policy that does not score its
    plans (the static modes)."""

    time_s: float
    reason: str
    predicted_s: float
    predicted_without_s: float


class TriggerStats(msgspec.Struct, kw_only=True):
    """The decisions one kind of trigger asked for: how many, how many of them the
    policy answered with a plan, and their wall-clock seconds in all."""

    decisions: int = 0
    plans: int = 0
    total_s: float = 0.0


class ControllerStats(msgspec.Struct, kw_only=True):
    """What the controller has done so far."""

    events_applied: int = 0
    events_rejected: dict[str, int] = msgspec.field(default_factory=dict)
    decisions: int = 0
    plans_committed: int = 0
    migrations_done: int = 0
    migrations_failed: int = 0
    plans_held_back: int = 0
    """Plans not committed because one of their moves failed recently (back-off)."""
    decision_s: list[float] = msgspec.field(default_factory=list)
    """Wall-clock seconds of the most recent decisions (up to 4096)."""
    decision_total_s: float = 0.0
    """Wall-clock seconds of every decision so far."""
    plans: list[CommittedPlan] = msgspec.field(default_factory=list)
    """The most recent committed plans (up to 4096), oldest first."""
    triggers: dict[str, TriggerStats] = msgspec.field(default_factory=dict)
    """The decisions so far by the kind of trigger that asked for them (where the
    decision time goes)."""


_TRIGGERS: dict[type[ev.Event], TriggerKind] = {
    ev.IterationStarted: "iteration_start",
    ev.IterationDone: "iteration_end",
    ev.TrainStepDone: "step_boundary",
    ev.MigrationDone: "placement_changed",
    ev.MigrationFailed: "placement_changed",
    ev.WorkerFailed: "placement_changed",
}

Listener = Callable[[ev.Event], None]


def _move(m: Migration) -> tuple[str | None, str | None, str]:
    """What a migration does, for back-off: from where, to where, how."""
    return (m.src, m.dst, m.kind)


class Controller:
    """The control loop.

    Args:
        graph: the hypergraph it keeps current (it owns it from now on).
        policy: the scheduling policy.
        executor: carries out committed migrations.
        clock: the time source (virtual in the simulator).
        predictor: fed with observed throughputs and migration costs, if given.
        tick_s: period of the ``tick`` trigger.
        max_backoff_s: a move that failed is not retried for ``tick_s * 2**failures``
            seconds, at most this long (a success resets it); when the back-off ends
            the policy is asked again.
        listeners: called with every applied event (timeline, metrics), in order.
        hold: decides which trainers should not start their next step yet (asked after
            every decision; a ``StepsHeld`` event, and their hypernodes' ``hold_steps``,
            say so to the workers).
    """

    def __init__(
        self,
        graph: Hypergraph,
        policy: Policy,
        executor: Executor,
        *,
        clock: Clock,
        predictor: Predictor | None = None,
        tick_s: float = 1.0,
        max_backoff_s: float = 60.0,
        listeners: Iterable[Listener] = (),
        hold: StepHold | None = None,
    ) -> None:
        self.graph = graph
        self.policy = policy
        self.hold = hold
        self.executor = executor
        self.clock = clock
        self.predictor = predictor
        self.tick_s = tick_s
        self.max_backoff_s = max_backoff_s
        self.listeners = list(listeners)
        self._stats = ControllerStats()
        self._rejected: Counter[str] = Counter()
        self._decision_s: deque[float] = deque(maxlen=4096)
        self._plans: deque[CommittedPlan] = deque(maxlen=4096)
        self._tg: TaskGroup | None = None
        self._stopped = False  # run() ended: plans from late events are dropped
        # Moves that failed recently, by (src, dst, kind): (retry not before, failures).
        self._backoff: dict[tuple[str | None, str | None, str], tuple[float, int]] = {}
        # Per stage: (items completed, work completed, occupied instance-seconds,
        # devices) when its capacity was last observed (see _observe_occupancy).
        self._occupancy: dict[ComponentId, tuple[int, float, float, int]] = {}
        # Per trainer: its work completed when its last optimizer step ended.
        self._step_mark: dict[ComponentId, float] = {}
        # Per rollout: until when its engines re-prefill requests a migration moved to
        # them (by the profile's prefill cost; see _note_reprefill).
        self._reprefill_until: dict[ComponentId, float] = {}
        # Per rollout: its engines' step counters over the last few seconds.
        self._decode_windows = DecodeWindows(graph.rate_tau_s)

    async def run(
        self,
        events: ObjectReceiveStream[ev.Event],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Apply events from ``events`` until it closes (or this task is cancelled)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._tick_loop)
            task_status.started()
            try:
                async with events:
                    async for event in events:
                        self.handle(event)
            finally:
                self._tg = None
                self._stopped = True
                tg.cancel_scope.cancel()

    def handle(self, event: ev.Event) -> None:
        """Apply one event now (stamped with the controller's clock) and act on it.

        A contradictory event is rejected, counted and logged once per type; it never
        stops the loop.
        """
        event = msgspec.structs.replace(event, time_s=self.clock.now())
        if not self._apply(event):
            return
        kind = _TRIGGERS.get(type(event))
        component = None
        if isinstance(event, ev.ItemCompleted):
            component = self.graph.instances[event.instance].component
            if self._drained(component):
                kind = "stage_drained"
        elif isinstance(event, ev.ItemsWithdrawn):
            # A partial rollout's end drains the stage as its last completion would.
            for c in self.graph.edges[event.edge].spec.consumers:
                if self._drained(c):
                    kind, component = "stage_drained", c
        elif isinstance(event, ev.TrainStepDone):
            component = event.component
            self._observe_step(event)
        elif isinstance(event, ev.ItemsEnqueued):
            # Work for a stage that holds no device: only a move can start it. Asked
            # each time its queue doubles (1, 2, 4, ... items waiting), and by the tick
            # between: asking at every arrival took 85% of the decision time
            # (~6,800 decisions a run).
            starved = [
                c
                for c in self.graph.edges[event.edge].spec.consumers
                if not self.graph.components[c].num_active
            ]
            waiting = len(self.graph.edges[event.edge].queue)
            before = max(0, waiting - len(event.items))
            if starved and waiting.bit_length() > before.bit_length():
                kind, component = "work_arrived", starved[0]
        if kind is not None:
            self.decide(Trigger(kind=kind, time_s=event.time_s, component=component))

    def _drained(self, component: ComponentId) -> bool:
        """Whether ``component`` has just run out of work for good: nothing pending
        for it, nor for any stage that feeds it.

        A stage whose feeders still work drains and refills many times an iteration
        (the scorer between two rollout completions: ~840 times in two iterations at
        math 1.5B on 128 devices, each a decision, together half the decision time);
        such a lull is the tick's to act on.
        """
        graph = self.graph
        if graph.pending(component):
            return False
        return not any(graph.pending(a) for a in graph.ancestors[component])

    def decide(self, trigger: Trigger) -> Plan:
        """Ask the policy for a plan and commit it."""
        t0 = time.perf_counter()
        plan = self.policy.decide(self.graph, trigger)
        if plan:
            self._commit(plan)
        if self.hold is not None:
            self._update_holds(self.hold.holds(self.graph))
        took = time.perf_counter() - t0
        self._decision_s.append(took)
        self._stats.decision_total_s += took
        self._stats.decisions += 1
        tally = self._stats.triggers.get(trigger.kind)
        if tally is None:
            tally = self._stats.triggers[trigger.kind] = TriggerStats()
        tally.decisions += 1
        tally.plans += bool(plan)
        tally.total_s += took
        return plan

    def _update_holds(self, held: frozenset[ComponentId]) -> None:
        for cid, node in self.graph.components.items():
            if node.hold_steps != (cid in held):
                # An event, so that listeners (a trainer waiting to step) hear of it.
                self._apply(ev.StepsHeld(component=cid, held=cid in held, time_s=self.clock.now()))
                logger.info(
                    "%s %s at its next step boundary", "hold" if cid in held else "release", cid
                )

    def statistics(self) -> ControllerStats:
        """A snapshot of the controller's counters."""
        s = self._stats
        return ControllerStats(
            events_applied=s.events_applied,
            events_rejected=dict(self._rejected),
            decisions=s.decisions,
            plans_committed=s.plans_committed,
            migrations_done=s.migrations_done,
            migrations_failed=s.migrations_failed,
            plans_held_back=s.plans_held_back,
            decision_s=list(self._decision_s),
            plans=list(self._plans),
            decision_total_s=s.decision_total_s,
            triggers={k: msgspec.structs.replace(v) for k, v in s.triggers.items()},
        )

    # ------------------------------------------------------------------ internals

    def _apply(self, event: ev.Event) -> bool:
        try:
            self.graph.apply(event)
        except EventError as exc:
            name = type(event).__name__
            if not self._rejected[name]:
                logger.warning("rejected %s (further ones are only counted): %s", name, exc)
            self._rejected[name] += 1
            return False
        self._stats.events_applied += 1
        for listener in self.listeners:
            listener(event)
        return True

    def _commit(self, plan: Plan) -> None:
        if self._tg is None and self._stopped:
            # A migration that failed as the run closed reports it after the loop
            # ended: nothing carries a plan out any more, and the run is closing.
            logger.info("plan dropped (the controller has stopped): %s", plan.reason)
            return
        if self._tg is None:
            raise RuntimeError("the controller is not running: start Controller.run first")
        now = self.clock.now()
        # (1 µs of slack: a sleep until the expiry may wake an ulp before it.)
        blocked = [
            m for m in plan.migrations if self._backoff.get(_move(m), (0.0, 0))[0] > now + 1e-6
        ]
        if blocked:
            # A move that just failed is not retried until its back-off has passed,
            # however often the (pure, memoryless) policy proposes it again.
            logger.debug("plan held back: %s failed recently", _move(blocked[0]))
            self._stats.plans_held_back += 1
            return
        logger.info("plan (%s): %s", self.policy.name, plan.reason)
        self._stats.plans_committed += 1
        self._plans.append(
            CommittedPlan(
                time_s=now,
                reason=plan.reason,
                predicted_s=plan.score_after,
                predicted_without_s=plan.score_before,
            )
        )
        for migration in plan.migrations:
            self._note_reprefill(migration)
            started = ev.MigrationStarted(migration=migration, time_s=self.clock.now())
            if self._apply(started):
                self._tg.start_soon(self._execute, migration)

    def _note_reprefill(self, migration: Migration) -> None:
        """Remember until when the engines ``migration`` sends requests to will stall
        re-prefilling them (they get them as the drain starts): a rate observed
        meanwhile is the stall, not the engines' decode speed."""
        cid = migration.src  # the drained engines' requests stay in their component
        if self.predictor is None or not migration.reassign or cid is None:
            return
        unit = self.graph.components[cid].spec.devices_per_instance
        cost = self.predictor.prefill_cost(cid, unit)
        if cost is None:
            return
        now = self.clock.now()
        until = max(self._reprefill_until.get(cid, now), now)
        self._reprefill_until[cid] = until + reprefill_span_s(self.graph, cost, migration)

    async def _execute(self, migration: Migration) -> None:
        t0 = self.clock.now()
        try:
            waited = await self.executor.execute(migration)
        except Exception as exc:  # the executor reports failure by raising
            logger.warning("migration %d failed: %s", migration.id, in_words(exc))
            self._stats.migrations_failed += 1
            _, failures = self._backoff.get(_move(migration), (0.0, 0))
            delay = min(self.max_backoff_s, self.tick_s * 2**failures)
            self._backoff[_move(migration)] = (self.clock.now() + delay, failures + 1)
            if self._tg is not None:
                self._tg.start_soon(self._ask_again_after, delay)
            self.handle(ev.MigrationFailed(migration=migration.id, reason=str(exc)))
            return
        duration = self.clock.now() - t0
        self._stats.migrations_done += 1
        self._backoff.pop(_move(migration), None)
        if self.predictor is not None:
            self.predictor.observe_migration(migration.kind, max(0.0, duration - (waited or 0.0)))
        self.handle(ev.MigrationDone(migration=migration.id, duration_s=duration))

    async def _ask_again_after(self, delay_s: float) -> None:
        # Policies that act only on placement changes (the static ones) would never
        # see a trigger once the failed move's back-off has passed.
        await self.clock.sleep(delay_s)
        self.decide(Trigger(kind="placement_changed", time_s=self.clock.now()))

    async def _tick_loop(self) -> None:
        while True:
            await self.clock.sleep(self.tick_s)
            now = self.clock.now()
            self._observe_tick(now)
            self.decide(Trigger(kind="tick", time_s=now))

    def _observe_tick(self, now: float) -> None:
        if self.predictor is None:
            return
        for cid, node in self.graph.components.items():
            devices = node.num_active_devices
            if not devices:
                self._occupancy.pop(cid, None)
                self._decode_windows.forget(cid)
                continue
            if node.spec.kind == "rollout":
                self._observe_rollout(self.predictor, cid, node, devices, now)
            elif node.spec.kind != "actor":  # the actor is observed per optimizer step
                self._observe_occupancy(self.predictor, cid, node, devices, now)

    def _observe_rollout(
        self, predictor: Predictor, cid: ComponentId, node: HyperNode, devices: int, now: float
    ) -> None:
        """Observe a rollout's decode rate: over a window of its engines' step counters
        where they count their steps (:class:`DecodeWindows`; the prefill seconds
        apart), else their summed recent rates, which mix in the prefills."""
        unit = node.spec.devices_per_instance  # its engines' size: each has its own fit
        if counts_steps(node):
            sample = self._decode_windows.sample(node, now)
            if sample is None:
                return
            predictor.observe(
                cid, devices, sample.load, sample.throughput, context=sample.context, unit=unit
            )
            # (The engines count a moved request's re-prefill apart: the move's cost,
            # priced where the move is scored, control/reprefill.py.)
            predictor.observe_prefill(
                cid, devices, sample.load, sample.prefill_device_s, sample.tokens
            )
            return
        self._decode_windows.forget(cid)
        stalled_until = self._reprefill_until.get(cid, -math.inf)
        active = list(node.active_instances())
        load = float(sum(n.num_running for n in active))
        rate = sum(n.gen_tokens_per_s for n in active)
        settled = min(node.work_rate.age(now), now - stalled_until)
        if settled < node.work_rate.tau_s:
            # Resized, or re-prefilling requests moved to its engines, within the
            # meter's time constant: the fit would take the stall for a per-request
            # cost (and, past that, drive the step's fixed cost to zero: on simulated
            # math 7B, 199 long requests moved to 8 engines stalled them ~15 s and the
            # predicted rollout end jumped by 270 s).
            return
        if load > 0 and rate > 0:
            predictor.observe(cid, devices, load, rate, context=active_context(node), unit=unit)

    def _observe_occupancy(
        self, predictor: Predictor, cid: ComponentId, node: HyperNode, devices: int, now: float
    ) -> None:
        """Observe what a stage's devices can do: work completed per instance-second
        its instances held items, times its instances. (Its completion rate would be
        its inputs' arrival rate whenever it waits for them: observing that would
        teach the predictor the stage is slow exactly when it is starved.) Observed
        once its instances have held items for the rate meter's time constant each
        on average, on the same devices throughout."""
        occupied = node.occupied_until(now)
        mark = self._occupancy.get(cid)
        if mark is None or mark[3] != devices:
            self._occupancy[cid] = (node.items_completed, node.work_completed, occupied, devices)
            return
        done = node.items_completed - mark[0]
        work = node.work_completed - mark[1]
        held = occupied - mark[2]
        if held < node.work_rate.tau_s * max(node.num_active, 1):
            return
        self._occupancy[cid] = (node.items_completed, node.work_completed, occupied, devices)
        if done > 0 and work > 0:
            load = float(max(self.graph.pending(cid), done))
            predictor.observe(cid, devices, load, work / held * node.num_active)

    def _observe_step(self, event: ev.TrainStepDone) -> None:
        """Observe the trainer's rate over its last optimizer step: the work of the
        items it completed in it (their tokens, once items carry sizes) per second."""
        node = self.graph.components.get(event.component)
        if node is None:
            return
        mark = self._step_mark.get(event.component, 0.0)
        self._step_mark[event.component] = node.work_completed
        if self.predictor is None or event.duration_s <= 0:
            return
        work = node.work_completed - mark if self.graph.sized else float(event.num_samples)
        if work > 0:
            devices = node.num_active_devices
            rate = work / event.duration_s
            self.predictor.observe(event.component, devices, event.num_samples, rate)
