"""Liveness: a stage with work and no device gets one whole instance.

Whatever the other policies predict, a stage that has pending items and holds no
device can never finish them; the iteration would wait forever. This policy, after the
phase rules in a dynamic chain (which may do more for the stage), gives such a stage
the smallest valid instance count it can run at, from the free pool first and then
from the stages with no work left (the most devices first). It is a floor, not a
schedule: the other policies resize from there.

Given a ``fuller`` policy (the bottleneck policy behind it in a dynamic chain), a
starved stage takes that policy's plan instead whenever the plan starts the stage too:
a floor committed first would hold every later move until its own migration ends, and
the stage would be started and then grown, paying two moves' latency in a row. On
simulated 32B agentic at 64 GPUs, inference was started on one instance at the
rollout's end and grown to the cluster only after that move's 4.7 s: 4.7 s of the
iteration (672.5 s) with 56 devices waiting.

A stage resized only between long steps (the trainer, at optimizer-step boundaries)
is different: a step started on one replica runs on it to its end, however many
devices free up meanwhile (in a simulated agentic iteration, 118 s on 4 devices while
60 sat waiting for the step boundary). Such a stage is not started while items are
still on their way to it: its predecessors' devices flow down to it as they finish
(the actor takes the cluster, or the bottleneck policy grows it when that pays). Once
nothing is on its way, the floor holds as for any stage.
"""

from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.scheduler import Policy, Trigger
from dynarl.control.scoring import demands


class StarvedStage:
    """Start every stage that has work but no instance."""

    name = "starved-stage"

    def __init__(self, estimates: Estimates | None = None, fuller: Policy | None = None) -> None:
        self.estimates = or_fresh(estimates)
        self.fuller = fuller

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """A plan giving the first starved stage (pipeline order) its smallest valid
        size -- or the ``fuller`` policy's plan, if that starts the stage too;
        nothing when no stage is starved or a move is under way."""
        if graph.migrations:
            return EMPTY_PLAN
        for stage in graph.stage_order:
            node = graph.components[stage]
            if node.num_active or not graph.pending(stage):
                continue
            if (
                node.spec.interruptible_at == "optimizer_step"
                and demands(graph, estimates=self.estimates)[stage].upstream
            ):
                continue  # devices flow down to it as its predecessors finish
            sizes = range(1, min(node.spec.max_instances, graph.num_devices) + 1)
            target = next((k for k in sizes if node.spec.is_valid_size(k)), None)
            if target is None:
                return EMPTY_PLAN
            idle = [
                c
                for c, n in graph.components.items()
                if c != stage and n.num_active and not graph.pending(c)
            ]
            donors = sorted(idle, key=lambda c: -graph.components[c].num_active_devices)
            builder = PlanBuilder(graph)
            if builder.gather(stage, target, donors) and builder.migrations:
                fuller = self.fuller.decide(graph, trigger) if self.fuller else EMPTY_PLAN
                started = sum(len(m.create) for m in fuller.migrations if m.dst == stage)
                if started >= target:
                    return fuller
                return builder.build(f"{stage} has work and no device: start it")
        return EMPTY_PLAN
