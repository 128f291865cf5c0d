"""Instance level: spread the rollout tail's hot engines over the idle ones.

Requests stay on the engine they were routed to, and the responses of one prompt are
alike in length, so by the rollout's tail a few engines hold most of the long requests
(a decode step there reads much more KV and is several times slower) while most others
idle. The rollout ends when its slowest engine does. Once no request waits for a slot,
this policy drains the most loaded engines and restarts each on its own devices,
sending their requests (generated tokens kept; the destination re-prefills them) one
by one to the least loaded engines (:meth:`~dynarl.control.planner.PlanBuilder.spread`).
A few candidates (the 1, 2, 4, ... hottest engines above the mean load) are scored by
the predictor, whose rollout model sees the most loaded engine
(:func:`~dynarl.control.scoring.score_plan`), and the best is committed only if it
beats keeping the placement by ``min_gain``, migration cost and re-prefill included.

No spread is made while sessions are in a tool call: each comes back to the engine
holding its KV prefix, and restarting engines would lose those prefixes (on simulated
agentic 32B at 128 devices, spreads during the rollout cost 49 s an iteration).

A spread must also leave every engine less loaded than the engines it drains were on
average. The drained engines restart empty and their requests land on the others: when
half the engines are hot (not a tail, an uneven start), moving the hot half's requests
onto the cold half only swaps which half is hot, and the next tick swaps them back --
on 128 simulated 1.5B engines that churned 64 engines every 3.5 s for 170 s.
"""

import math

from dynarl.control.config import SchedulerConfig
from dynarl.control.demand import Rates
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder, spread_peak
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import demands, remaining_time, score_plan


class RebalanceTail:
    """Move requests from the most loaded rollout engines to the least loaded."""

    name = "rebalance-tail"

    def __init__(
        self, cfg: SchedulerConfig, predictor: Predictor, estimates: Estimates | None = None
    ) -> None:
        self.cfg = cfg
        self.predictor = predictor
        self.estimates = or_fresh(estimates)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The best strictly improving spread of hot engines, or nothing."""
        if graph.migrations or trigger.kind in ("iteration_start", "iteration_end"):
            return EMPTY_PLAN
        demand = None
        before = {c: n.num_active_devices for c, n in graph.components.items()}
        for cid in graph.of_kind("rollout"):
            node = graph.components[cid]
            unit = node.spec.devices_per_instance
            if graph.waiting_for_slot(cid) or self.predictor.step_costs(cid, unit) is None:
                continue  # requests wait for a slot: the light engines will take them
            if any(e.num_in_tool for e in graph.edges_into(cid)):
                continue  # sessions in a tool call come back to their engine's KV prefix
            engines = sorted(node.active_instances(), key=lambda n: (-len(n.items), n.id))
            if len(engines) < 2:
                continue
            if not any(n.kv_usage < self.cfg.u_low for n in engines):
                continue  # no engine has room: moved requests would only re-prefill
            mean = sum(len(n.items) for n in engines) / len(engines)
            hot = [n for n in engines if len(n.items) > mean]
            if not hot:
                continue
            est = self.estimates
            if demand is None:
                demand = demands(graph, per_engine=True, estimates=est)
            rates = Rates(graph, self.predictor)  # shared by this rollout's candidates
            base = remaining_time(
                graph, self.predictor, before, demand=demand, estimates=est, rates=rates
            )
            # No spread can beat a perfectly even load (and none is free): if even that
            # bound does not gain ``min_gain``, build no candidate. Cheap, and most
            # ticks end here.
            even = dict(demand)
            even[cid] = demand[cid].with_hottest(math.ceil(mean))
            bound = remaining_time(
                graph, self.predictor, before, demand=even, estimates=est, rates=rates
            )
            if not bound < base * (1.0 - self.cfg.min_gain):
                continue
            best: tuple[float, int] | None = None
            for k in _counts(len(hot), len(engines) // 2, self.cfg.num_candidates):
                # Scored without the requests' destinations: they go one by one to
                # the least loaded engine, and only the peak load matters here.
                builder = PlanBuilder(graph, reassign=False)
                if builder.spread(cid, hot[:k]) is None:
                    continue
                moved = sum(len(n.items) for n in hot[:k])
                peak = spread_peak([len(n.items) for n in engines[k:]], moved)
                if peak >= moved / k:
                    continue  # it only moves the load, it does not spread it
                spread = dict(demand)
                spread[cid] = demand[cid].with_hottest(peak)
                candidate = builder.build("spread")
                score = score_plan(
                    graph,
                    self.predictor,
                    candidate,
                    before,
                    spread,
                    estimates=est,
                    placed=True,
                    rates=rates,
                )
                if best is None or score < best[0]:
                    best = (score, k)
            if best is not None and best[0] < base * (1.0 - self.cfg.min_gain):
                score, k = best
                builder = PlanBuilder(graph)
                builder.spread(cid, hot[:k])
                plan = builder.build(
                    f"rollout tail: spread the {k} most loaded engines "
                    f"({len(hot[0].items)} requests at most, {mean:.1f} mean)"
                )
                return Plan(
                    migrations=plan.migrations,
                    reason=f"{plan.reason}: predicted {base:.1f}s -> {score:.1f}s",
                    score_before=base,
                    score_after=score,
                )
        return EMPTY_PLAN


def _counts(num_hot: int, limit: int, budget: int) -> list[int]:
    """Candidate numbers of engines to spread: 1, 2, 4, ... up to ``num_hot`` (at most
    ``limit``, at most ``budget`` candidates), always including ``num_hot``."""
    top = max(1, min(num_hot, limit))
    out: list[int] = []
    k = 1
    while k < top and len(out) < budget - 1:
        out.append(k)
        k *= 2
    out.append(top)
    return out
