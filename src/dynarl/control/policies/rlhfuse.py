"""RLHFuse-style inter-stage fusion on a colocated schedule (a baseline).

The schedule is colocated (every device serves one stage at a time), except at the
rollout tail: once rollout's outstanding requests fall below a fraction of the batch,
they are consolidated onto as few engines as can run them at once
(``ceil(outstanding / max running per engine)``), and the freed devices start the
inference stage on the responses already finished. Training still waits for the whole
batch: the actor gets devices only when inference has drained, as in the colocated
schedule.
"""

import math

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.colocated import ColocatedPolicy
from dynarl.control.scheduler import Trigger


class RlhfusePolicy:
    """Colocated stages, with the rollout tail fused with inference."""

    name = "rlhfuse"

    def __init__(self, tail_fraction: float) -> None:
        self.tail_fraction = tail_fraction
        self.colocated = ColocatedPolicy()

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """Fuse the tail when it begins; otherwise the colocated schedule."""
        if graph.migrations:
            return EMPTY_PLAN
        rollouts, inferences = graph.of_kind("rollout"), graph.of_kind("inference")
        if len(rollouts) != 1 or len(inferences) != 1 or trigger.kind == "iteration_start":
            return self.colocated.decide(graph, trigger)
        rollout, inference = rollouts[0], inferences[0]
        outstanding = graph.pending(rollout)
        if not outstanding:
            return self.colocated.decide(graph, trigger)
        if graph.components[inference].num_active:
            # Fused already: the tail keeps its engines until rollout drains (the
            # colocated rule would pull every device back to rollout here).
            return EMPTY_PLAN
        batch = sum(e.enqueued_this_iteration for e in graph.edges_into(rollout))
        if batch == 0 or outstanding > self.tail_fraction * batch:
            return self.colocated.decide(graph, trigger)
        spec = graph.components[rollout].spec
        cap = spec.max_load_per_instance or outstanding
        keep = max(1, math.ceil(outstanding / cap))
        builder = PlanBuilder(graph)
        now = builder.instances(rollout)
        if now <= keep:
            return EMPTY_PLAN
        builder.move(rollout, inference, drain=now - keep)
        if not builder.migrations:
            return EMPTY_PLAN
        return builder.build(
            f"rollout tail ({outstanding}/{batch} left): consolidate on {keep} engines, "
            "the rest start inference"
        )
