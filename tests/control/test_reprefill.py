"""What re-prefilling a drained engine's requests costs: the scorer's spelled-out sum is
the per-request formula summed, to the bit, for running, waiting and returning
(prefix-holding) requests."""

from dynarl.control import events as ev
from dynarl.control.predictor_profile import PrefillCost
from dynarl.control.reprefill import engine_reprefill_s
from dynarl.control.topology import PROMPTS
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .test_item_sizes import sized_graph

E0 = InstanceId("rollout-0")


def test_an_engines_reprefill_is_the_sum_of_its_requests_costs() -> None:
    g = sized_graph(expected_tokens=1000.0)
    sizes = [37, 120, 5, 260, 91]
    refs = tuple(ev.ItemRef(ItemId(f"r{k}"), GroupId("g"), n) for k, n in enumerate(sizes))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    stats = {"instance": E0, "kv_usage": 0.2, "num_queued": 0}
    g.apply(ev.EngineStats(num_running=4, gen_tokens_per_s=0.0, time_s=1.0, **stats))
    g.apply(ev.EngineStats(num_running=4, gen_tokens_per_s=333.3, time_s=2.0, **stats))
    # A session leaves for a tool holding a long prefix and comes back to the queue; one
    # more report moves the others on, and one request is preempted (waits again).
    g.apply(ev.ToolCallStarted(edge=PROMPTS, item=ItemId("r1"), instance=E0, prefix_tokens=900))
    g.apply(ev.ToolCallFinished(edge=PROMPTS, item=ItemId("r1")))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("r1"), instance=E0))
    g.apply(ev.EngineStats(num_running=3, gen_tokens_per_s=77.7, time_s=3.0, **stats))
    node = g.instances[E0]
    assert len(node.items) == 5 and node.started and node.waiting
    cost = PrefillCost(s_per_token=3.1e-5, s_per_token_context=7.3e-9, kv_capacity_tokens=1e6)
    expected = 0.0
    for item, edge in node.items.items():
        expected += cost.seconds(node.context_of(g.edges[edge].items[item]))
    assert engine_reprefill_s(g, node, cost) == expected
    assert node.context_of(g.edges[PROMPTS].items[ItemId("r1")]) == 900
