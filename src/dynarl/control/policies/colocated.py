"""Static colocated scheduling (like verl): every device serves one stage at a time.

At iteration start every device goes to the first stage (rollout); when a stage has
drained the iteration's work, every device goes to the next stage with work. Devices
move only at these stage boundaries (and a boundary move that failed is retried when
the placement changes).
"""

from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import demands


class ColocatedPolicy:
    """All devices to the current stage, at stage boundaries only."""

    name = "colocated"

    def __init__(self, estimates: Estimates | None = None) -> None:
        self.estimates = or_fresh(estimates)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """Move every device to the current stage on ``iteration_start`` and
        ``stage_drained`` (or retry after ``placement_changed``); nothing otherwise."""
        if graph.migrations or trigger.kind not in (
            "iteration_start",
            "stage_drained",
            "placement_changed",
        ):
            return EMPTY_PLAN
        order = graph.stage_order
        if trigger.kind == "iteration_start":
            stage = order[0]
        else:
            demand = demands(graph, estimates=self.estimates)
            pending = [c for c in order if demand[c].work > 0]
            if not pending:
                return EMPTY_PLAN
            stage = pending[0]
        others = [c for c in order if c != stage and graph.components[c].num_active]
        spare = len(graph.free_devices) + sum(
            graph.components[c].num_active_devices for c in others
        )
        spec = graph.components[stage].spec
        now = graph.components[stage].num_active
        # The largest valid size whole replicas can form; every other stage is drained
        # whatever it is (in a colocated schedule only one stage runs).
        for target in range(now + spare // spec.devices_per_instance, now - 1, -1):
            if not spec.is_valid_size(target):
                continue
            builder = PlanBuilder(graph)
            if builder.gather(stage, target, others, drain_rest=True) and builder.migrations:
                return builder.build(f"colocated: every device to {stage}")
        return EMPTY_PLAN
