"""Failure recovery: reboot instances on the devices of crashed workers."""

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.scheduler import Baseline, Trigger


class RebootCrashed:
    """Give crashed workers' devices back to the components that lost them.

    A crashed worker's devices return to the free pool; this policy reboots instances
    there for the components furthest below their initial device count, so a crash
    is a scale-in that heals itself.
    """

    name = "reboot-crashed"

    def __init__(self, baseline: Baseline) -> None:
        self.baseline = dict(baseline)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """A reboot plan when crashed devices are free; else nothing."""
        if not graph.crashed_devices:
            return EMPTY_PLAN
        builder = PlanBuilder(graph)
        crashed = sorted(graph.crashed_devices)
        deficits = sorted(
            (
                (graph.components[c].num_active_devices - want, c)
                for c, want in self.baseline.items()
                if graph.components[c].num_active_devices < want
            ),
        )
        for _, cid in deficits:
            unit = graph.components[cid].spec.devices_per_instance
            available = [d for d in builder.free_devices() if d in graph.crashed_devices]
            if len(available) < unit:
                break
            missing = self.baseline[cid] - builder.moved_devices()[cid]
            count = min(missing, len(available)) // unit
            if count:
                builder.move(None, cid, take_free=available[: count * unit], create=count)
        if not builder.migrations:
            return EMPTY_PLAN
        return builder.build(f"reboot on crashed devices {crashed}")
