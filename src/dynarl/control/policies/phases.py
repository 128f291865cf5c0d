"""Iteration-phase policies (from the reference system, as rules).

* :class:`RolloutBorrowsActor`: at iteration start the actor has nothing to train, so
  rollout borrows its devices; once rollout's outstanding requests fall below a
  fraction of the batch *and* its engines are under-used (the donor signal of
  :mod:`~dynarl.control.policies.donors`), rollout's surplus over its initial share
  goes back, as many engines as are under-used. (The reference's rule returns them on
  the count alone; with many long requests left, the engines are still full, and
  taking them away slows the tail more than the actor gains.)
* :class:`ActorTakesCluster`: once every other stage has finished the iteration's work
  (the actor's last minibatch can only start then), the actor takes every device they
  hold, at its largest valid data-parallel size.
"""

from collections.abc import Callable
from typing import Literal

from dynarl.control.config import SchedulerConfig
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.donors import underused_engines
from dynarl.control.scheduler import Baseline, Trigger
from dynarl.control.scoring import demands
from dynarl.core.ids import ComponentId


class RolloutBorrowsActor:
    """Lend the actor's devices to rollout at iteration start; return them for the tail.

    ``phase`` limits it to the lending (``"start"``) or the return (``"return"``), so
    a chain can gate the two differently. ``engine_size``, where given, says at how
    many devices each the rollout's engines start when it borrows while it has none
    (:func:`~dynarl.control.policies.resize.tail_unit`: at its tail size); where it
    answers 0, or the rollout still has engines, no borrow is made. A chain offers
    this borrow beside the one at the rollout's own size, and the predictor picks.
    """

    name = "rollout-borrows-actor"

    def __init__(
        self,
        baseline: Baseline,
        cfg: SchedulerConfig,
        *,
        phase: Literal["start", "return", "both"] = "both",
        engine_size: Callable[[Hypergraph, ComponentId], int] | None = None,
    ) -> None:
        self.baseline = dict(baseline)
        self.cfg = cfg
        self.phase = phase
        self.engine_size = engine_size
        if phase != "both":
            self.name = f"rollout-borrows-actor-{phase}"
        if engine_size is not None:
            self.name += "-resized"

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """Borrow on ``iteration_start`` (or when the batch arrives at a rollout
        without devices); hand back on later triggers."""
        if graph.migrations:
            return EMPTY_PLAN
        rollouts, actors = graph.of_kind("rollout"), graph.of_kind("actor")
        if len(rollouts) != 1 or len(actors) != 1:
            return EMPTY_PLAN
        rollout, actor = rollouts[0], actors[0]
        builder = PlanBuilder(graph)
        starting = trigger.kind == "iteration_start" or (
            trigger.kind == "work_arrived" and trigger.component == rollout
        )
        if (self.phase == "start" and not starting) or (self.phase == "return" and starting):
            return EMPTY_PLAN  # the other phase's trigger
        if starting:
            # The actor has nothing to train until a minibatch arrives. (The batch's
            # requests arrive just after ``iteration_start``; if rollout holds no
            # device then, their arrival is the moment to borrow.)
            if graph.pending(actor) or not graph.components[actor].num_active:
                return EMPTY_PLAN
            unit = 0
            if self.engine_size is not None:
                unit = self.engine_size(graph, rollout)
                if not unit or graph.components[rollout].num_active:
                    return EMPTY_PLAN
            active = graph.components[actor].num_active
            keep = min(builder.shrink_targets(actor), default=active)
            if not builder.move(actor, rollout, drain=active - keep, unit=unit):
                return EMPTY_PLAN
            reason = "iteration start: rollout borrows the actor's devices"
            if unit:
                reason += f", its engines at {unit} devices"
            return builder.build(reason)
        node = graph.components[rollout]
        surplus = node.num_active_devices - self.baseline.get(rollout, 0)
        batch = sum(e.enqueued_this_iteration for e in graph.edges_into(rollout))
        outstanding = graph.pending(rollout)
        if surplus <= 0 or batch == 0 or outstanding > self.cfg.borrow_return_fraction * batch:
            return EMPTY_PLAN
        low = underused_engines(graph, rollout, self.cfg, trigger.time_s)
        if not low:
            return EMPTY_PLAN
        unit = node.spec.devices_per_instance
        builder.move(rollout, actor, drain=min(surplus // unit, low))
        if not builder.migrations:
            return EMPTY_PLAN
        return builder.build(
            f"rollout tail ({outstanding}/{batch} requests left): return borrowed devices"
        )


class ActorTakesCluster:
    """Before the actor's last minibatch, give it every device other stages hold idle."""

    name = "actor-takes-cluster"

    def __init__(self, estimates: Estimates | None = None) -> None:
        self.estimates = or_fresh(estimates)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """Grow the actor once it is the only stage with work left."""
        if graph.migrations or trigger.kind == "tick":
            return EMPTY_PLAN
        actors = graph.of_kind("actor")
        if len(actors) != 1:
            return EMPTY_PLAN
        actor = actors[0]
        demand = demands(graph, estimates=self.estimates)
        if demand[actor].work <= 0:
            return EMPTY_PLAN
        if any(d.work > 0 for c, d in demand.items() if c != actor):
            # (Sessions out on a tool call that may come back for another turn are
            # rollout work: rollout_lengths.returning_sessions.)
            return EMPTY_PLAN
        idle = [c for c in demand if c != actor and graph.components[c].num_active]
        spare = len(graph.free_devices) + sum(graph.components[c].num_active_devices for c in idle)
        now = graph.components[actor].num_active
        spec = graph.components[actor].spec
        top = now + spare // spec.devices_per_instance
        for target in range(top, now, -1):
            if spec.is_valid_size(target):
                builder = PlanBuilder(graph)
                donors = sorted(idle, key=lambda c: graph.components[c].num_active_devices)
                if builder.gather(actor, target, donors):
                    return builder.build("last minibatch: the actor takes the cluster")
        return EMPTY_PLAN
