"""What re-prefilling moved requests costs a rollout's engines.

A migration moves requests without their KV: the engine each lands on recomputes its
context (prompt and tokens generated so far), compute-bound, stalling its running
requests meanwhile, at the profile's :class:`~dynarl.control.predictor.PrefillCost`.
:func:`reprefill_s` is what a candidate plan's donor loses (the scorer's penalty);
:func:`reprefill_span_s` how long a committed move's receiving engines stall (the
controller observes no decode rate meanwhile).
"""

from functools import partial

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
    cost = predictor.prefill_cost(cid)
    keep = graph.components[cid].num_active - num_drained
    if cost is None or keep <= 0:
        return 0.0
    total = 0.0
    for n in drained:
        # An engine's sum changes only when it reports (progress) or its requests change.
        state = (n.last_stats_s, len(n.items), n.progress_base, n.tokens_per_request)
        total += est.reprefill_s(
            graph, n.id, state, cost, partial(engine_reprefill_s, graph, n, cost)
        )
    return total / keep


def engine_reprefill_s(graph: Hypergraph, node: Node, cost: PrefillCost) -> float:
    """Seconds to re-prefill every request ``node`` holds, one after another: the sum
    of :meth:`PrefillCost.seconds` over their contexts (:meth:`Node.context_of`).

    Spelled out rather than calling those two per request (the same arithmetic in the
    same order, so the same sum to the bit): a decision's candidates re-read tens of
    engines of tens of requests each, and the two calls per request were most of the
    time the scorer spent on re-prefills."""
    a, b = cost.s_per_token, cost.s_per_token_context
    per_token = node.tokens_per_request
    edges = graph.edges
    out = 0.0
    for item, edge in node.items.items():
        st = edges[edge].items[item]
        if st.running:
            context = st.tokens + (st.generated + per_token - st.mark)
        else:
            context = st.tokens + st.generated
        context = max(context, st.prefix_tokens)
        context = max(context, 0.0)
        out += context * (a + b * context / 2.0)
    return out


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
