"""The simulated router's rollout side: stickiness to the engine holding a request's
KV prefix, and when another engine may take it anyway."""

from dynarl.core.ids import InstanceId, ItemId
from dynarl.data.request_order import FifoOrder, ToolCallPriorityOrder
from dynarl.sim.router import RequestRouter

A, B = InstanceId("rollout-0"), InstanceId("rollout-1")


def test_a_request_sticks_to_the_engine_holding_its_prefix() -> None:
    r = RequestRouter(FifoOrder())
    r.add(ItemId("on-a"), now_s=0.0, prefix_tokens=500, engine=A)
    r.add(ItemId("fresh"), now_s=1.0)
    # B may run the fresh request but not A's session while it is busy.
    assert r.pop_for(B, 2.0, steal=False) == ItemId("fresh")
    assert r.pop_for(B, 2.0, steal=False) is None
    assert r.pop_for(A, 2.0) == ItemId("on-a")
    assert r.num_stolen == 0


def test_only_an_idle_engine_takes_a_session_another_engine_holds() -> None:
    """A busy engine gains next to nothing from one more request in its memory-bound
    batch and would stall it to re-prefill the session; an idle engine would idle."""
    r = RequestRouter(FifoOrder())
    r.add(ItemId("on-a"), now_s=0.0, prefix_tokens=500, engine=A)
    assert r.pop_for(B, 1.0, steal=False) is None
    assert r.pop_for(B, 1.0, steal=True) == ItemId("on-a")
    assert r.num_stolen == 1 and len(r) == 0


def test_a_gone_engines_sessions_are_free_for_any_engine() -> None:
    r = RequestRouter(FifoOrder())
    r.add(ItemId("on-a"), now_s=0.0, prefix_tokens=500, engine=A)
    r.forget_engine(A)
    assert r.pop_for(B, 1.0, steal=False) == ItemId("on-a")
    assert r.num_stolen == 0


def test_priority_serves_more_tool_calls_first_and_aging_bounds_the_wait() -> None:
    r = RequestRouter(ToolCallPriorityOrder(), aging_factor=2.0, aging_floor_s=5.0)
    r.add(ItemId("fresh"), now_s=0.0)
    r.add(ItemId("turn-3"), now_s=1.0, tool_calls=2)
    assert r.pop_for(A, 1.0) == ItemId("turn-3")
    r.add(ItemId("turn-2"), now_s=2.0, tool_calls=1)
    # "fresh" has waited past the floor (the mean wait is small): served first.
    assert r.pop_for(A, 6.0) == ItemId("fresh")
    assert r.num_aged == 1
    assert r.pop_for(A, 6.0) == ItemId("turn-2")


def test_an_overdue_session_is_served_first_by_its_own_engine_not_by_a_busy_one() -> None:
    r = RequestRouter(FifoOrder(), aging_factor=2.0, aging_floor_s=1.0)
    r.add(ItemId("on-a"), now_s=0.0, prefix_tokens=500, engine=A)
    r.add(ItemId("fresh"), now_s=4.0)
    assert r.pop_for(B, 5.0, steal=False) == ItemId("fresh")
    assert r.num_aged == 0
    r.add(ItemId("fresh-2"), now_s=5.0)
    assert r.pop_for(A, 6.0, steal=False) == ItemId("on-a")
    assert r.num_aged == 1
