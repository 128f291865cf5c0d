"""What re-prefilling moved requests costs a rollout's engines.

A migration moves requests without their KV: the engine each lands on recomputes its
context (prompt and tokens generated so far), compute-bound, stalling its running
requests meanwhile, at the profile's :class:`~dynarl.control.predictor.PrefillCost`.
:func:`reprefill_s` is what a candidate plan's donor loses (the scorer's penalty);
:func:`reprefill_span_s` how long a committed move's receiving engines stall (the
controller observes no decode rate meanwhile).
"""

import bisect
from collections.abc import Iterable
from functools import partial
from itertools import accumulate

from dynarl.control.elements import Node
from dynarl.control.estimates import Estimates
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import Migration
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import PrefillCost
from dynarl.core.ids import ComponentId, InstanceId


def reprefill_s(
    graph: Hypergraph,
    predictor: Predictor,
    cid: ComponentId,
    drained: list[Node],
    num_drained: int,
    *,
    est: Estimates,
) -> float:
    """Seconds each engine ``cid`` keeps stalls re-prefilling the requests of its
    ``drained`` engines (0 without a measured prefill cost). The candidates of every
    decision drain the same engines over and over: each engine's sum is kept in
    ``est`` while its state stays."""
    node = graph.components[cid]
    cost = predictor.prefill_cost(cid, node.spec.devices_per_instance)
    keep = node.num_active - num_drained
    if cost is None or keep <= 0:
        return 0.0
    return engines_reprefill_s(graph, cost, drained, est=est) / keep


def engines_reprefill_s(
    graph: Hypergraph, cost: PrefillCost, engines: Iterable[Node], *, est: Estimates
) -> float:
    """Seconds one engine of ``cost`` takes to re-prefill every request ``engines``
    hold, one after another (each engine's sum kept in ``est`` while its state stays)."""
    total = 0.0
    for n in engines:
        stall = est.per_engine(graph, n, cost, partial(EngineReprefill, n, cost))
        total += stall.seconds(n.tokens_per_request)
    return total


class EngineReprefill:
    """Seconds to re-prefill every request one engine holds, one after another (the
    sum of :meth:`PrefillCost.seconds` over their contexts, :meth:`Node.context_of`),
    as a function of the engine's tokens per running request.

    A running request's context is ``r + t``, ``r`` its prompt and what it had
    generated when it started less that mark, ``t`` the engine's tokens per running
    request (or its cached prefix, if longer); only ``t`` changes as the engine
    reports. So the sum over the requests whose context passes their prefix is a
    quadratic in ``t`` (from the sums of ``r`` and ``r^2``), plus what the others'
    prefixes and the waiting requests cost: :meth:`seconds` is a bisection and a few
    products, however many requests the engine holds (each decision's candidates
    re-read tens of engines of tens of requests each, and the engines report
    between any two decisions). Built from the engine as it is; valid while it
    holds and runs the same requests (:attr:`Node.version`)."""

    __slots__ = ("_a", "_b", "_fixed", "_prefix_s", "_r1", "_r2", "_thresholds")

    def __init__(self, node: Node, cost: PrefillCost) -> None:
        self._a, self._b = cost.s_per_token, cost.s_per_token_context / 2.0
        # Waiting requests: their context does not move with the engine's progress.
        self._fixed = sum([cost.seconds(node.context_of(st)) for st in node.waiting.values()])
        # Running ones, by the progress past which their context passes their prefix.
        running = sorted(
            (st.prefix_tokens - r, r, st.prefix_tokens)
            for st in node.started.values()
            for r in (st.tokens + st.generated - st.mark,)
        )
        self._thresholds = [x[0] for x in running]
        self._r1 = list(accumulate((x[1] for x in running), initial=0.0))
        self._r2 = list(accumulate((x[1] * x[1] for x in running), initial=0.0))
        # Suffix sums of their prefixes' costs (for those still short of it).
        self._prefix_s = list(
            accumulate((cost.seconds(x[2]) for x in reversed(running)), initial=0.0)
        )
        self._prefix_s.reverse()

    def seconds(self, tokens_per_request: float) -> float:
        """The sum at ``tokens_per_request`` tokens per running request."""
        t = tokens_per_request
        k = bisect.bisect_right(self._thresholds, t)  # contexts past their prefix
        s1, s2 = self._r1[k], self._r2[k]
        # sum over them of a (r + t) + b/2 (r + t)^2
        passed = self._a * (s1 + k * t) + self._b * (s2 + 2.0 * t * s1 + k * t * t)
        return self._fixed + passed + self._prefix_s[k]


def reprefill_span_s(graph: Hypergraph, cost: PrefillCost, migration: Migration) -> float:
    """Seconds until the engines ``migration`` sends its drained engines' requests to
    (its ``reassign``) have re-prefilled them: each engine re-prefills the requests
    sent to it one after another (their contexts as they stand now), the engines side
    by side. Requests that finished meanwhile are skipped."""
    where = dict(migration.reassign)
    per_engine: dict[InstanceId, float] = {}
    for iid in migration.drain:
        node = graph.instances.get(iid)
        if node is None:
            continue
        for item, edge in node.items.items():
            dst = where.get(item)
            if dst is not None:
                seconds = cost.seconds(node.context_of(graph.edges[edge].items[item]))
                per_engine[dst] = per_engine.get(dst, 0.0) + seconds
    return max(per_engine.values(), default=0.0)
