"""Component-level dynamic scheduling: move devices from donors to the bottleneck.

*Donors* are components that can give devices without slowing the iteration much:

* a rollout component when no request waits for a slot and more than ``theta`` of
  its engines have kept KV usage below ``u_low`` for ``donor_window_s`` seconds with
  nothing queued (it may give up to those engines, keeping one while it has work),
  or when its requests fit on fewer engines (it may give the rest; see
  :mod:`~dynarl.control.policies.donors`);
* any component with no work left in this iteration (all its instances);
* a component that is idle, waiting for its inputs (all but its minimum);
* a trainer whose only step left is the last minibatch of whole groups formed in
  completion order, running no step while work is still upstream (all but its
  minimum): that minibatch holds the iteration's last groups, so it cannot start
  before they are done, and its devices idle until then (on simulated math 7B, 32
  devices for 37 s);
* the free pool.

*Receivers* are the components with work left, the predicted slowest first. For each
donor/receiver pair a few amounts are tried (one instance, half, all it can give, then
a quarter, an eighth, ...), up to ``num_candidates`` plans per receiver (taken in turn
across receivers); the predictor scores each as the predicted
remaining iteration time including the migration's cost, and the best is committed only
if it beats keeping the placement by ``min_gain``. Devices can move in every direction:
rollout, inference and the actor each grow and shrink within an iteration.
"""

import itertools
import math
from collections.abc import Iterator, Set

from dynarl.control.config import SchedulerConfig
from dynarl.control.demand import Demand, Rates
from dynarl.control.elements import HyperNode, Node
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.donors import spare_engines, underused_engines
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import demands, remaining_time, score_plan
from dynarl.core.ids import ComponentId

_Size = tuple[ComponentId | None, ComponentId, int]
"""A candidate move: from a donor, the instances it drains; from the free pool
(``None``), the instance count the receiver grows to."""


class BottleneckPolicy:
    """Move devices to the predicted bottleneck when the predictor says it pays."""

    name = "bottleneck"

    def __init__(
        self, cfg: SchedulerConfig, predictor: Predictor, estimates: Estimates | None = None
    ) -> None:
        self.cfg = cfg
        self.predictor = predictor
        self.estimates = or_fresh(estimates)

    def donatable(self, graph: Hypergraph, cid: ComponentId, demand: Demand, now_s: float) -> int:
        """How many instances ``cid`` can give up now (0 if it is not a donor).

        A component with work left this iteration keeps at least one instance, so
        the work still flowing to it cannot strand.
        """
        node = graph.components[cid]
        if not node.num_active:
            return 0
        if demand.work <= 0:
            return node.num_active - node.spec.min_instances
        keep = max(node.spec.min_instances, 1)
        if node.spec.kind == "rollout":
            low = underused_engines(graph, cid, self.cfg, now_s)
            return max(0, min(max(low, spare_engines(graph, cid)), node.num_active - keep))
        if graph.pending(cid) == 0 or _waits_for_last_groups(node, demand):
            return max(0, node.num_active - keep)  # idle, waiting for its inputs
        return 0

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The best strictly improving plan, or nothing."""
        if graph.migrations or trigger.kind == "iteration_end":
            return EMPTY_PLAN
        now = trigger.time_s
        demand = demands(graph, estimates=self.estimates)
        order = graph.stage_order
        before = {c: graph.components[c].num_active_devices for c in order}
        donors: list[tuple[ComponentId | None, int]] = [
            (c, k) for c in order if (k := self.donatable(graph, c, demand[c], now)) > 0
        ]
        if graph.free_devices:
            donors.append((None, len(graph.free_devices)))
        receivers = [c for c in order if demand[c].work > 0 and self._known(graph, c, demand[c])]
        if any(not before[c] and not demand[c].upstream for c in receivers):
            # A component with work and no device stalls the iteration: anyone with an
            # instance to spare may give one (the predictor still picks the best).
            named = {c for c, _ in donors}
            for c in order:
                spare = graph.components[c].num_active - 1
                if c not in named and spare > 0:
                    donors.append((c, spare))
        if not donors or not receivers:
            return EMPTY_PLAN
        rates = Rates(graph, self.predictor)  # this decision's: shared by its candidates
        base = remaining_time(graph, self.predictor, before, demand=demand, rates=rates)
        # Receivers that gain most from one more instance first; candidates are taken
        # round-robin over receivers so one receiver cannot use up the budget.
        receivers.sort(key=lambda c: -self._gain(graph, c, before, demand, rates))
        per_receiver = [
            [
                (src, dst, amount)
                for src, give in donors
                if src != dst and (src is None or self._known(graph, src, demand[src]))
                for amount in _amounts(give)
            ]
            for dst in receivers
        ]
        best: tuple[float, _Size] | None = None
        seen: set[tuple[object, ...]] = set()
        tried: set[_Size] = set()  # sizes built already: their plans are known
        orders: dict[ComponentId, list[Node]] = {}  # drain orders, shared by the candidates
        sizes = _Sizes(graph, orders, working={c for c in order if demand[c].work > 0})
        for src, dst, amount in _round_robin(per_receiver):
            if len(seen) >= self.cfg.num_candidates * len(receivers):
                break
            size = sizes(src, dst, amount)
            if size is None or size in tried:
                continue  # no valid size, or another amount that snapped to the same one
            tried.add(size)
            candidate = self._candidate(graph, size, reassign=False, orders=orders)
            if candidate is None:
                continue
            signature = tuple((m.src, m.dst, m.drain, m.devices) for m in candidate.migrations)
            if signature in seen:
                continue
            seen.add(signature)
            score = score_plan(
                graph,
                self.predictor,
                candidate,
                before,
                demand,
                estimates=self.estimates,
                rates=rates,
            )
            if best is None or score < best[0]:
                best = (score, size)
        if best is None or not best[0] < base * (1.0 - self.cfg.min_gain):
            return EMPTY_PLAN
        score, size = best
        # Only the winner needs its requests redistributed.
        plan = self._candidate(graph, size, reassign=True)
        assert plan is not None
        return Plan(
            migrations=plan.migrations,
            reason=f"{plan.reason}: predicted {base:.1f}s -> {score:.1f}s",
            score_before=base,
            score_after=score,
        )

    def _known(self, graph: Hypergraph, cid: ComponentId, demand: Demand) -> bool:
        # A component with no work left needs no prediction; otherwise act only on a
        # fitted model (a guess in made-up units cannot be weighed against seconds).
        if demand.work <= 0:
            return True
        unit = graph.components[cid].spec.devices_per_instance
        load = max(demand.load, 1.0)
        return self.predictor.predict(cid, 1, load, unit=unit).num_observations >= 2

    def _gain(
        self,
        graph: Hypergraph,
        cid: ComponentId,
        devices: dict[ComponentId, int],
        demand: dict[ComponentId, Demand],
        rates: Rates,
    ) -> float:
        """Seconds of ``cid``'s own work one more instance would save."""
        d = demand[cid]
        unit = graph.components[cid].spec.devices_per_instance
        now = rates(cid, devices[cid], d)
        more = rates(cid, devices[cid] + unit, d)
        if more <= 0:
            return 0.0
        return (d.work / now if now > 0 else float("inf")) - d.work / more

    def _candidate(
        self,
        graph: Hypergraph,
        size: _Size,
        *,
        reassign: bool,
        orders: dict[ComponentId, list[Node]] | None = None,
    ) -> Plan | None:
        src, dst, count = size
        builder = PlanBuilder(graph, reassign=reassign, orders=orders)
        if src is None:
            unit = graph.components[dst].spec.devices_per_instance
            free = builder.free_devices()[: (count - builder.instances(dst)) * unit]
            builder.move(None, dst, take_free=free)
        else:
            m = builder.move(src, dst, drain=count)
            if m is None or not m.create:
                return None
        label = "free devices" if src is None else f"{src}"
        return builder.build(f"{label} -> {dst}")


class _Sizes:
    """The move each candidate makes, for one decision: ``sizes(src, dst, amount)`` is
    what a candidate of ``amount`` instances from ``src`` to ``dst`` moves (``None``:
    no valid move). From the free pool, ``dst`` grows to the largest valid size
    ``amount`` free devices reach; from a donor, to the smallest valid shrink that
    gives at least ``amount`` instances, if its drained devices make at least one
    instance of ``dst``. Two amounts with one size make one plan.

    A donor with work left (in ``working``) gives devices in whole instances of
    ``dst``: an amount whose devices do not divide into them (seven 4-device engines
    for 8-device replicas) drains the largest multiple that does, and the rest go on
    with the donor's work. Left over, they would idle in the free pool until a later
    decision spends them, and the scheduler's model, which lets only a stage's own and
    its predecessors' devices join it, scores them as lost to the end of the iteration
    (so on agentic 32B such moves never won, and the rollout's tail never handed
    engines to inference). Devices a valid size of ``dst`` leaves over (a trainer of
    16 replicas given 28 devices' worth) still go to the free pool: the next decision
    hands them on at once, a move to two receivers in two steps."""

    def __init__(
        self,
        graph: Hypergraph,
        orders: dict[ComponentId, list[Node]],
        working: Set[ComponentId],
    ) -> None:
        self.graph = graph
        self.working = working
        self.probe = PlanBuilder(graph, reassign=False, orders=orders)  # no moves: sizes
        self.num_free = len(self.probe.free_devices())
        # Per donor and amount: the instances it drains and their devices.
        self._drains: dict[tuple[ComponentId, int], tuple[int, int] | None] = {}

    def __call__(self, src: ComponentId | None, dst: ComponentId, amount: int) -> _Size | None:
        probe = self.probe
        if src is None:
            target = probe.grow_target(dst, min(amount, self.num_free))
            return None if target <= probe.instances(dst) else (None, dst, target)
        drains = self._drain(src, amount)
        unit = self.graph.components[dst].spec.devices_per_instance
        if drains is not None and drains[1] % unit and src in self.working:
            src_unit = self.graph.components[src].spec.devices_per_instance
            step = math.lcm(src_unit, unit) // src_unit  # donor instances per whole one
            if drains[0] >= step:
                drains = self._drain(src, drains[0] // step * step)
        if drains is None:
            return None
        drain, num_devices = drains
        # As ``PlanBuilder.move`` sizes the instances it creates.
        create = min(
            probe.grow_target(dst, num_devices) - probe.instances(dst), num_devices // unit
        )
        return None if create <= 0 else (src, dst, drain)

    def _drain(self, src: ComponentId, amount: int) -> tuple[int, int] | None:
        key = (src, amount)
        if key not in self._drains:
            now = self.probe.instances(src)
            shrink = self.probe.shrink_target(src, now - amount)
            if shrink is None:
                self._drains[key] = None
            else:
                drained = self.probe.drainable(src, now - shrink)
                self._drains[key] = (now - shrink, sum(len(n.devices) for n in drained))
        return self._drains[key]


def _round_robin(
    lists: list[list[tuple[ComponentId | None, ComponentId, int]]],
) -> Iterator[tuple[ComponentId | None, ComponentId, int]]:
    """Items of ``lists`` interleaved: the first of each, then the second of each..."""
    for row in itertools.zip_longest(*lists):
        yield from (x for x in row if x is not None)


def _waits_for_last_groups(node: HyperNode, demand: Demand) -> bool:
    """Whether ``node`` is a trainer idle before its last step, which trains the
    iteration's last groups in completion order and so waits for the work still
    upstream (samples already here cannot start it)."""
    return (
        node.spec.kind == "actor"
        and node.spec.steps_in_arrival_order
        and node.steps_left == 1
        and not node.num_in_flight()
        and demand.upstream > 0
    )


def _amounts(give: int) -> list[int]:
    """Instance counts to try for a donor that can give ``give``, in the order they are
    tried: one, half and all, then a quarter, an eighth, ... (a 26-engine rollout's
    best move may be 4 engines, between one and half)."""
    out = [1, max(1, give // 2), give]
    k = give // 4
    while k > 1:
        out.append(k)
        k //= 2
    return list(dict.fromkeys(out))
