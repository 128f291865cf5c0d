"""Multi-turn sessions out on a tool call are rollout work: each is expected back for
another turn as often as the sessions out after as many turns came back, so a rollout
whose sessions are all out on tools is not judged done and keeps its engines."""

import pytest

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.policies.phases import ActorTakesCluster
from dynarl.control.rollout_lengths import returning_sessions
from dynarl.control.scoring import demands, finish_times
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT, TO_ACTOR
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .graphs import make_graph
from .test_policies import enqueue, predictor_for, tick


def out_on_tools(g: Hypergraph, n: int, prefix: str = "s") -> list[ItemId]:
    """``n`` sessions, routed over the rollout's engines; each finishes its first turn
    and leaves on a tool call."""
    items = enqueue(g, PROMPTS, n, prefix)
    engines = sorted(g.components[ROLLOUT].instances)
    for k, item in enumerate(items):
        engine = engines[k % len(engines)]
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=engine))
        g.apply(ev.ToolCallStarted(edge=PROMPTS, item=item, instance=engine))
    g.check()
    return items


def end_in_tool(g: Hypergraph, item: ItemId) -> None:
    """The session's environment ends it while it is out on a tool call."""
    last = g.edges[PROMPTS].items[item].last_instance
    assert last is not None
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=item, instance=last, num_tokens=50))


def test_sessions_out_on_a_tool_come_back_as_often_as_those_after_as_many_turns_did() -> None:
    g = make_graph(rollout=4)
    items = out_on_tools(g, 16)
    assert returning_sessions(g, ROLLOUT) == 16  # nothing seen yet: every one comes back
    for item in items[:6]:  # six come back for a second turn
        g.apply(ev.ToolCallFinished(edge=PROMPTS, item=item))
    for item in items[6:10]:  # four end after their first
        end_in_tool(g, item)
    g.check()
    pooled = (6 + 1) / (10 + 1)
    after_one = (6 + pooled) / (10 + 1)
    assert returning_sessions(g, ROLLOUT) == pytest.approx(6 * after_one)
    # The six start their second turn and leave again: none seen after two turns yet.
    for k, item in enumerate(items[:6]):
        engine = InstanceId(f"rollout-{k % 4}")
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=engine))
        g.apply(ev.ToolCallStarted(edge=PROMPTS, item=item, instance=engine))
    g.check()
    assert g.edges[PROMPTS].in_tool_turns == {1: 6, 2: 6}
    assert returning_sessions(g, ROLLOUT) == pytest.approx(6 * after_one + 6 * pooled)


def test_a_rollout_whose_sessions_are_out_on_tools_is_not_done() -> None:
    """Before, the sessions out on a tool counted for no load: the rollout's finish
    was predicted the same on one engine as on four, so its engines looked free."""
    g = make_graph(rollout=4, inference=1, actor=1, actor_sizes=(1, 2, 4, 8))
    out_on_tools(g, 64)
    p = predictor_for(g)
    d = demands(g)[ROLLOUT]
    assert d.work > 0 and d.load == 64
    devices = {ROLLOUT: 4, INFERENCE: 1, ACTOR: 1}
    on_four = finish_times(g, p, devices)[ROLLOUT]
    on_one = finish_times(g, p, devices | {ROLLOUT: 1})[ROLLOUT]
    assert on_one > 1.2 * on_four


def test_the_actor_takes_the_cluster_only_once_no_session_may_come_back() -> None:
    g = make_graph(rollout=4, inference=2, actor=1, free=1, actor_sizes=(1, 2, 4))
    enqueue(g, TO_ACTOR, 64, "a")
    items = out_on_tools(g, 2)
    policy = ActorTakesCluster()
    assert not policy.decide(g, tick(1.0, "stage_drained"))  # they may come back
    end_in_tool(g, items[0])
    assert not policy.decide(g, tick(2.0, "stage_drained"))  # one may still
    end_in_tool(g, items[1])
    g.apply(ev.ItemsEnqueued(edge=TO_ACTOR, items=(ev.ItemRef(ItemId("a-s"), GroupId("g")),)))
    assert policy.decide(g, tick(3.0, "stage_drained"))
