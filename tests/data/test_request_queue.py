"""The request queue: two orders (FIFO, tool-call priority) of one bounded, closable,
observable queue, with an aging bound that keeps every request from starving."""

from dataclasses import dataclass

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.core.clock import ManualClock
from dynarl.core.errors import ConfigError
from dynarl.data import AgingBound, RequestQueue
from dynarl.data.request_order import FifoOrder, ToolCallPriorityOrder


@dataclass(frozen=True)
class Req:
    name: str
    tool_calls: int = 0
    prefix_tokens: int = 0


def _queue(
    order: object = None,
    *,
    max_size: int = 100,
    aging: AgingBound | None = None,
    clock: ManualClock | None = None,
) -> tuple[RequestQueue[Req], ManualClock]:
    clock = clock or ManualClock()
    q: RequestQueue[Req] = RequestQueue(
        order or ToolCallPriorityOrder(), max_size=max_size, clock=clock, aging=aging
    )
    return q, clock


def _drain(q: RequestQueue[Req]) -> list[str]:
    out = []
    while len(q):
        out.append(q.get_nowait().name)
    return out


def test_fifo_serves_in_arrival_order() -> None:
    q, clock = _queue(FifoOrder())
    for k, name in enumerate("abcd"):
        q.put_nowait(Req(name, tool_calls=k, prefix_tokens=10 * k))
        clock.advance(0.01)
    assert _drain(q) == list("abcd")


def test_priority_serves_more_tool_calls_then_longer_prefix_then_age() -> None:
    q, clock = _queue()
    for req in [
        Req("fresh"),
        Req("t1-short", 1, 5),
        Req("t2", 2, 0),
        Req("t1-long", 1, 50),
        Req("fresh2"),
        Req("t1-short2", 1, 5),
    ]:
        q.put_nowait(req)
        clock.advance(0.01)
    assert _drain(q) == ["t2", "t1-long", "t1-short", "t1-short2", "fresh", "fresh2"]


def test_without_aging_a_fresh_request_starves_behind_later_turns() -> None:
    """The reference behaviour, kept as a comparison: no age term, so a stream of
    requests with completed tool calls starves a fresh one for as long as it lasts."""
    q, clock = _queue(aging=None)
    q.put_nowait(Req("fresh"))
    served = []
    for k in range(200):
        q.put_nowait(Req(f"turn{k}", tool_calls=1))
        clock.advance(0.1)
        served.append(q.get_nowait().name)
    assert "fresh" not in served


def test_aging_bound_serves_the_starving_request() -> None:
    q, clock = _queue(aging=AgingBound(factor=3.0, floor_s=0.5))
    q.put_nowait(Req("fresh"))
    waits = {}
    for k in range(200):
        q.put_nowait(Req(f"turn{k}", tool_calls=1))
        clock.advance(0.1)
        bound = q.age_bound_s
        name = q.get_nowait().name
        if name == "fresh":
            waits["fresh"] = clock.now()
            assert clock.now() <= bound + 0.1
    assert "fresh" in waits
    stats = q.statistics()
    assert stats.num_aged == 1
    # Every other request was served at once: the mean wait stays small.
    assert stats.mean_wait_s < 0.2 and stats.max_wait_s == pytest.approx(waits["fresh"])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "tick"]),
            st.integers(0, 3),
            st.integers(0, 3),
            st.floats(0.0, 2.0),
        ),
        max_size=120,
    ),
    st.floats(1.0, 5.0),
    st.floats(0.0, 1.0),
)
def test_property_bound_or_order(
    ops: list[tuple[str, int, int, float]], factor: float, floor_s: float
) -> None:
    """Under any put/get sequence: when some request has waited past the aging bound,
    the oldest is served; otherwise the smallest priority key is. Nothing is lost."""
    order = ToolCallPriorityOrder()
    q, clock = _queue(order, max_size=1000, aging=AgingBound(factor=factor, floor_s=floor_s))
    waiting: dict[str, tuple[Req, float, int]] = {}
    served: list[str] = []
    for seq, (op, tools, prefix, dt) in enumerate(ops):
        if op == "put":
            req = Req(f"r{seq}", tools, 100 * prefix)
            q.put_nowait(req)
            waiting[req.name] = (req, clock.now(), seq)
        elif op == "tick":
            clock.advance(dt)
        elif waiting:
            bound = q.age_bound_s
            now = clock.now()
            got = q.get_nowait()
            oldest = min(waiting.values(), key=lambda w: w[2])
            if now - oldest[1] > bound:
                assert got is oldest[0], "an overdue request was skipped"
            else:
                best = min(
                    waiting.values(),
                    key=lambda w: (-w[0].tool_calls, -w[0].prefix_tokens, w[1], w[2]),
                )
                assert got is best[0], "the priority order was not followed"
            served.append(got.name)
            del waiting[got.name]
        else:
            with pytest.raises(anyio.WouldBlock):
                q.get_nowait()
    assert len(q) == len(waiting)
    assert sorted(_drain(q)) == sorted(waiting)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=60),
    st.integers(1, 4),
)
def test_property_no_request_waits_past_the_bound_when_served_often_enough(
    reqs: list[tuple[int, int]], per_tick: int
) -> None:
    """With arrivals at most as fast as service, every request's wait stays within the
    aging bound in force when it is served (plus one service interval)."""
    q, clock = _queue(max_size=1000, aging=AgingBound(factor=2.0, floor_s=0.3))
    arrivals = {}
    for k, (tools, prefix) in enumerate(reqs):
        for j in range(per_tick):
            req = Req(f"r{k}.{j}", tools, prefix)
            q.put_nowait(req)
            arrivals[req.name] = clock.now()
        for _ in range(per_tick):
            clock.advance(0.05)
            bound = q.age_bound_s
            got = q.get_nowait()
            assert clock.now() - arrivals[got.name] <= bound + 0.05 * per_tick + 1e-9


async def test_get_waits_for_a_put_and_put_waits_for_room() -> None:
    q, _ = _queue(max_size=2)
    got: list[str] = []

    async def consumer() -> None:
        got.append((await q.get()).name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await anyio.wait_all_tasks_blocked()
        assert q.statistics().num_waiting_getters == 1
        q.put_nowait(Req("a"))
    assert got == ["a"]

    q.put_nowait(Req("b"))
    q.put_nowait(Req("c"))
    with pytest.raises(anyio.WouldBlock):
        q.put_nowait(Req("d"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(q.put, Req("d"))
        await anyio.wait_all_tasks_blocked()
        assert q.statistics().num_waiting_putters == 1
        assert q.get_nowait().name == "b"
    assert _drain(q) == ["c", "d"]


async def test_a_cancelled_getter_does_not_swallow_a_wakeup() -> None:
    q, _ = _queue()
    got: list[str] = []
    first = anyio.CancelScope()

    async def cancelled_consumer() -> None:
        with first:
            got.append((await q.get()).name)

    async def consumer() -> None:
        got.append((await q.get()).name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_consumer)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(consumer)
        await anyio.wait_all_tasks_blocked()
        q.put_nowait(Req("x"))  # wakes the first getter ...
        first.cancel()  # ... which is cancelled before (or as) it takes the request
        await anyio.wait_all_tasks_blocked()
        # Never a request waiting while a getter sleeps on a consumed wake-up.
        assert not (len(q) and q.statistics().num_waiting_getters)
        assert got == ["x"]
        tg.cancel_scope.cancel()


async def test_close_lets_getters_drain_then_end() -> None:
    q, _ = _queue()
    q.put_nowait(Req("a"))
    q.close()
    with pytest.raises(anyio.ClosedResourceError):
        q.put_nowait(Req("b"))
    with pytest.raises(anyio.ClosedResourceError):
        await q.put(Req("b"))
    assert (await q.get()).name == "a"
    with pytest.raises(anyio.EndOfStream):
        await q.get()
    with pytest.raises(anyio.EndOfStream):
        q.get_nowait()
    assert q.statistics().closed


async def test_close_wakes_a_waiting_getter() -> None:
    q, _ = _queue()
    ended = []

    async def consumer() -> None:
        try:
            await q.get()
        except anyio.EndOfStream:
            ended.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await anyio.wait_all_tasks_blocked()
        q.close()
    assert ended == [True]


def test_take_all_returns_everything_oldest_first_and_statistics_add_up() -> None:
    q, clock = _queue()
    for k in range(5):
        q.put_nowait(Req(f"r{k}", tool_calls=k % 2))
        clock.advance(1.0)
    assert q.get_nowait().name == "r1"
    assert [r.name for r in q.take_all()] == ["r0", "r2", "r3", "r4"]
    assert len(q) == 0
    stats = q.statistics()
    assert (stats.num_put, stats.num_got, stats.depth) == (5, 1, 0)
    assert stats.mean_wait_s == pytest.approx(4.0)
    assert stats.order == "priority"


def test_batch_get_follows_the_same_order() -> None:
    q, _ = _queue()
    for k in range(6):
        q.put_nowait(Req(f"r{k}", prefix_tokens=k))
    assert [r.name for r in q.get_batch_nowait(4)] == ["r5", "r4", "r3", "r2"]
    assert [r.name for r in q.get_batch_nowait(10)] == ["r1", "r0"]
    assert q.get_batch_nowait(3) == []


def test_lazy_deletion_keeps_memory_proportional_to_depth() -> None:
    q, clock = _queue(aging=AgingBound(factor=1.0, floor_s=0.0))
    for k in range(5000):
        q.put_nowait(Req(f"r{k}", tool_calls=k % 3))
        clock.advance(0.01)
        q.get_nowait()
    assert len(q) == 0
    assert len(q._heap) < 200 and len(q._arrivals) < 200


def test_invalid_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        AgingBound(factor=0.5)
    with pytest.raises(ConfigError):
        _queue(max_size=0)
