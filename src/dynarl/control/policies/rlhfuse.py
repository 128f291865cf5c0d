"""RLHFuse-style inter-stage fusion on a colocated schedule (a baseline).

The schedule is colocated (every device serves one stage at a time), except at the
rollout tail. RLHFuse migrates the remaining samples onto a few generation instances
once they are few enough that this does not slow them: a decode step is memory-bound,
its time set by the weights plus the KV cache it reads, so packing the tail onto fewer
engines costs nothing as long as no engine then reads more KV than the busiest one
already does (that engine sets the tail's pace). So the tail needs
``keep = max(ceil(running / max running per engine), ceil(total KV / busiest KV))``
engines, and fusion happens once ``keep`` is at most ``tail_fraction`` of rollout's
engines: the tail has begun. The freed devices start the inference stage on the
responses already finished. Training still waits for the whole batch: the actor gets
devices only when inference has drained, as in the colocated schedule.
"""

import math
from collections.abc import Sequence

from dynarl.control.elements import Node
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
        engines = list(graph.components[rollout].active_instances())
        if batch == 0 or not engines:
            return self.colocated.decide(graph, trigger)
        cap = graph.components[rollout].spec.max_load_per_instance
        keep = tail_engines(engines, cap, waiting=graph.queue_depth(rollout))
        if keep > self.tail_fraction * len(engines):
            return self.colocated.decide(graph, trigger)
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


def tail_engines(engines: Sequence[Node], max_running: int, *, waiting: int = 0) -> int:
    """Engines the requests of ``engines`` (running and queued there or at the data
    router, plus ``waiting`` not yet routed) fit on without any engine holding more
    requests than ``max_running`` (0: no cap) or more KV than the busiest holds now (so
    no decode step gets slower)."""
    running = waiting + sum(max(len(n.items), n.num_running + n.num_queued) for n in engines)
    by_count = math.ceil(running / max_running) if max_running else 1
    busiest = max((n.kv_usage for n in engines), default=0.0)
    by_kv = math.ceil(sum(n.kv_usage for n in engines) / busiest - 1e-9) if busiest > 0 else 1
    return max(1, by_count, by_kv)
