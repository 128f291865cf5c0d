"""What re-prefilling a drained engine's requests costs: the per-engine model (a
quadratic in the engine's progress, kept while it holds the same requests) is the
per-request formula summed, for running, waiting and returning (prefix-holding)
requests, before and after a request's context passes its prefix."""

import msgspec
import pytest

from dynarl.control import events as ev
from dynarl.control.elements import Node
from dynarl.control.estimates import Estimates
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec
from dynarl.control.predictor_profile import PrefillCost
from dynarl.control.reprefill import EngineReprefill
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.ids import DeviceId, GroupId, InstanceId, ItemId

from .test_item_sizes import sized_graph
from .test_rollout_lengths import report

E0 = InstanceId("rollout-0")
COST = PrefillCost(s_per_token=3.1e-5, s_per_token_context=7.3e-9, kv_capacity_tokens=1e6)


def direct(g: Hypergraph, node: Node, per_token: float) -> float:
    """The per-request formula summed, at ``per_token`` tokens per running request."""
    out = 0.0
    for item, edge in node.items.items():
        st = g.edges[edge].items[item]
        context = st.tokens + st.generated + (per_token - st.mark if st.running else 0.0)
        out += COST.seconds(max(context, st.prefix_tokens))
    return out


def test_an_engines_reprefill_is_the_sum_of_its_requests_costs() -> None:
    g = sized_graph(expected_tokens=1000.0)
    sizes = [37, 120, 5, 260, 91, 44]
    refs = tuple(ev.ItemRef(ItemId(f"r{k}"), GroupId("g"), n) for k, n in enumerate(sizes))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    report(g, 3, 0.0, 1.0)
    report(g, 3, 333.3, 2.0)
    # Two sessions leave for a tool holding long prefixes and come back; one of them
    # runs again (its context short of its prefix), the other waits.
    for item, prefix in (("r1", 900), ("r2", 2000)):
        g.apply(
            ev.ToolCallStarted(edge=PROMPTS, item=ItemId(item), instance=E0, prefix_tokens=prefix)
        )
        g.apply(ev.ToolCallFinished(edge=PROMPTS, item=ItemId(item)))
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId(item), instance=E0))
    report(g, 5, 77.7, 3.0)
    node = g.instances[E0]
    items = g.edges[PROMPTS].items
    assert items[ItemId("r1")].running and not items[ItemId("r2")].running
    assert node.context_of(items[ItemId("r1")]) == 900
    model = EngineReprefill(node, COST)
    t = node.tokens_per_request
    exact = sum(COST.seconds(node.context_of(items[i])) for i in node.items)
    assert model.seconds(t) == pytest.approx(exact, rel=1e-12)
    # As the engine reports more progress, r1's context passes its prefix.
    for later in (t + 300.0, t + 900.0, t + 5000.0):
        assert model.seconds(later) == pytest.approx(direct(g, node, later), rel=1e-12)
    assert direct(g, node, t + 900.0) > direct(g, node, t)


def test_an_engines_model_is_kept_until_its_requests_change() -> None:
    g = sized_graph(expected_tokens=1000.0)
    refs = tuple(ev.ItemRef(ItemId(f"r{k}"), GroupId("g"), 10 * (k + 1)) for k in range(3))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    report(g, 2, 0.0, 1.0)
    est = Estimates()
    node = g.instances[E0]
    first = est.per_engine(g, node, COST, lambda: EngineReprefill(node, COST))
    report(g, 2, 50.0, 2.0)  # progress only: the same model serves
    assert est.per_engine(g, node, COST, lambda: EngineReprefill(node, COST)) is first
    assert first.seconds(node.tokens_per_request) == pytest.approx(
        direct(g, node, node.tokens_per_request)
    )
    report(g, 3, 50.0, 3.0)  # one more request runs: built again
    again = est.per_engine(g, node, COST, lambda: EngineReprefill(node, COST))
    assert again is not first
    assert again.seconds(node.tokens_per_request) == pytest.approx(
        direct(g, node, node.tokens_per_request)
    )


def test_models_of_engines_gone_from_the_hypergraph_are_dropped() -> None:
    g = sized_graph(expected_tokens=1000.0)
    est = Estimates()
    live = g.instances[E0]
    spec = InstanceSpec(id=InstanceId("gone"), devices=(DeviceId(0),))
    for k in range(50):  # engines that restarted under new ids, drained once each
        dead = Node(msgspec.structs.replace(spec, id=InstanceId(f"gone-{k}")), ROLLOUT, 0.0)
        est.per_engine(g, dead, COST, lambda dead=dead: EngineReprefill(dead, COST))
        est.per_engine(g, live, COST, lambda: EngineReprefill(live, COST))
    kept = est._engines
    assert len(kept) <= 2 * len(g.instances) + 1
    assert kept[E0][0] is live
