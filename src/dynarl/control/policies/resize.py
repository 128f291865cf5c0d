"""Instance level: regroup the rollout's engines into wider ones for its tail.

A decode step costs a fixed part -- a launch overhead, the weights read split over the
engine's ``tp`` devices, the all-reduces -- plus a part per token of context its
requests read, split over the same devices. At a full batch the fixed part is shared
by many requests, and narrow engines yield the most tokens per device; in the tail,
where each engine decodes a few long requests, it is most of their time, and engines
of ``tail_tp`` devices (``ComponentSpec.tail_devices_per_instance``) end them sooner on
the same devices: each step reads its share of the weights from more devices, and the
requests' KV reads per device stay as they were. That is elastic tensor parallelism
for the long tail (RollPacker's long rounds).

This policy scores regrouping every engine at once
(:meth:`~dynarl.control.planner.PlanBuilder.regroup`: drained, their requests back in
the queue, each re-prefilled on a wide engine) against keeping them, with the
predictor's decode model at each size (``Predictor.step_costs(cid, unit)``, seeded by a
profile that measured both and refined online), the move's cost and the re-prefill of
every running request included, and commits it when it beats keeping the engines by
``min_gain``. The engines stay wide until the rollout has no instance left (the
iteration's end). The next iteration's borrow of the trainer's devices is scored at
both sizes (:func:`tail_unit` says where the wide one may be offered; the dynamic mode
puts the two borrows behind one :class:`~dynarl.control.policies.gate.PredictorGate`),
so where the wide engines win from the start they are made at once, not regrouped.

With requests waiting for a slot, the predictor models the rollout as waves of full
batches (each request holding its slot until it ends), and the regroup, which halves
the slots, is scored that way: on simulated math 32B, where wide engines are better
from the start, it regroups at the iteration's start and gains 6-7%. Multi-turn
sessions do not hold their slots that way (they leave for their tools and come back),
so once the rollout has seen a tool call no regroup is made while requests wait: on
simulated agentic 32B such a regroup, 8 s into the iteration, rested on a prediction
that put the narrow engines' iteration 24% above what it took, and cost 4.5%. Nor while
sessions are in a tool call: each comes back to the engine holding its KV prefix,
which a regroup would lose (as :mod:`~dynarl.control.policies.rebalance` says).
"""

from dynarl.control.config import SchedulerConfig
from dynarl.control.demand import Rates
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.predictor import Predictor
from dynarl.control.reprefill import engines_reprefill_s
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import demands, remaining_time
from dynarl.core.ids import ComponentId


class ResizeEngines:
    """Regroup a rollout's engines into its tail size when the predictor says it pays."""

    name = "resize-engines"

    def __init__(
        self, cfg: SchedulerConfig, predictor: Predictor, estimates: Estimates | None = None
    ) -> None:
        self.cfg = cfg
        self.predictor = predictor
        self.estimates = or_fresh(estimates)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The regroup of a rollout's engines into its tail size, if it gains."""
        if graph.migrations or trigger.kind in ("iteration_start", "iteration_end"):
            return EMPTY_PLAN
        for cid in graph.of_kind("rollout"):
            plan = self._regroup(graph, cid)
            if plan:
                return plan
        return EMPTY_PLAN

    def _regroup(self, graph: Hypergraph, cid: ComponentId) -> Plan:
        node = graph.components[cid]
        unit = node.spec.devices_per_instance
        wide = tail_unit(graph, cid, self.predictor)
        if not wide or node.num_active < 2 or not graph.pending(cid):
            return EMPTY_PLAN
        builder = PlanBuilder(graph, reassign=False)
        migration = builder.regroup(cid, wide)
        if migration is None:
            return EMPTY_PLAN
        est = self.estimates
        demand = demands(graph, estimates=est)
        before = {c: n.num_active_devices for c, n in graph.components.items()}
        base = remaining_time(graph, self.predictor, before, demand=demand, estimates=est)
        after = dict(before)
        after[cid] = sum(len(s.devices) for s in migration.create)
        during = dict(before)
        during[cid] = 0  # every engine stops while the wide ones come up
        score = remaining_time(
            graph,
            self.predictor,
            after,
            delays={cid: self.predictor.migration_cost(migration.kind)},
            penalties={cid: self._reprefill_s(graph, cid, len(migration.create), wide)},
            before=during,
            demand=demand,
            estimates=est,
            rates=Rates(graph, self.predictor, units={cid: wide}),
        )
        if not score < base * (1.0 - self.cfg.min_gain):
            return EMPTY_PLAN
        return builder.build(
            f"rollout tail: regroup {node.num_active} engines of {unit} devices into "
            f"{len(migration.create)} of {wide}: predicted {base:.1f}s -> {score:.1f}s",
            score_before=base,
            score_after=score,
        )

    def _reprefill_s(self, graph: Hypergraph, cid: ComponentId, num_wide: int, wide: int) -> float:
        """Seconds each of ``num_wide`` wide engines stalls re-prefilling its share of
        every running request's context (0 without a measured prefill cost): what
        the narrow engines would take for them, ``wide / tp`` times faster (prefill is
        compute-bound), spread over the wide engines."""
        node = graph.components[cid]
        cost = self.predictor.prefill_cost(cid, node.spec.devices_per_instance)
        if cost is None or num_wide <= 0:
            return 0.0
        total = engines_reprefill_s(graph, cost, node.active_instances(), est=self.estimates)
        return total * node.spec.devices_per_instance / wide / num_wide


def tail_unit(graph: Hypergraph, cid: ComponentId, predictor: Predictor) -> int:
    """The tail size (devices an engine) rollout ``cid``'s engines may take now, or 0:
    none other than their size now, sessions in a tool call, requests waiting for a
    slot once a tool call has been seen (the module docstring says why), or a size the
    predictor has no decode model for."""
    node = graph.components[cid]
    unit = node.spec.devices_per_instance
    wide = node.base_spec.tail_devices_per_instance
    if not wide or unit == wide:
        return 0
    if any(e.num_in_tool for e in graph.edges_into(cid)):
        return 0
    if graph.waiting_for_slot(cid) and (node.tool_returns or node.tool_ends):
        return 0  # waves of multi-turn sessions: see the module docstring
    if any(predictor.step_costs(cid, size) is None for size in (unit, wide)):
        return 0
    return wide
