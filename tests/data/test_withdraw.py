"""A partial rollout's end: pending items leave the run without completing, wherever
they are, keep the tokens they generated, and count them again when they come back."""

import pytest

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.errors import RoutingError
from dynarl.data.peers import WorkerState
from dynarl.data.placement import Placement, RoutedResult
from dynarl.data.routing import AffinityRouting

from .helpers import PROMPTS, ROLLOUT, CheckedGraph, item, start, worker


class _Worker:
    """The recall callback: records what was asked; the test answers later, as a
    worker's aborted results arrive after the ``Abort``."""

    def __init__(self) -> None:
        self.asked: list[tuple[InstanceId, tuple[ItemId, ...]]] = []

    def __call__(self, w: WorkerState, items: tuple[ItemId, ...], now: float) -> None:
        self.asked.append((w.instance, items))


def _setup() -> tuple[Placement, CheckedGraph, _Worker, WorkerState, WorkerState]:
    graph = CheckedGraph(["a", "b"])
    recalls = _Worker()
    p = Placement(
        {PROMPTS: (ROLLOUT,)},
        policy=AffinityRouting(seed=0),
        emit=graph,
        balance_on_join=False,
        balance_below_share=False,
        recall=recalls,
    )
    a, b = worker("a", 2), worker("b", 2)
    p.add_worker(a, 0.0)
    p.add_worker(b, 0.0)
    return p, graph, recalls, a, b


def _withdrawn_tokens(graph: CheckedGraph) -> dict[ItemId, int]:
    """The tokens each withdrawn item left with (``ItemsWithdrawn``)."""
    out: dict[ItemId, int] = {}
    for e in graph.of(ev.ItemsWithdrawn):
        assert isinstance(e, ev.ItemsWithdrawn)
        out.update(zip(e.items, e.generated or (0,) * len(e.items), strict=True))
    return out


async def test_queued_items_leave_at_once_and_running_ones_when_their_abort_returns() -> None:
    p, graph, recalls, a, b = _setup()
    p.admit([item(k) for k in range(8)], 0.0)
    start(a)
    start(b)
    running = {*a.in_flight, *b.in_flight}
    assert len(running) == 4
    # One running item reports partial progress on its way (an earlier abort).
    first = next(iter(a.in_flight))
    p.on_result(a, wire.ItemResult(item=first, status="aborted", num_tokens=5), 0.5)
    start(a)
    queued = {it.id for w in (a, b) for it in w.queue.queued()}
    leaving = sorted(p.pending - {next(iter(b.in_flight))})  # keep one running item
    taken = p.withdraw(leaving, 1.0)
    assert {it.id for it in taken} == queued & set(leaving)
    assert not any(it.id in leaving for w in (a, b) for it in w.queue.queued())
    in_flight_leaving = {i for _, ids in recalls.asked for i in ids}
    assert in_flight_leaving == set(leaving) - queued
    # Nothing routes a withdrawn item again: their aborts come back with their tokens.
    for w in (a, b):
        for i in [i for i in w.in_flight if i in in_flight_leaving]:
            out = p.on_result(w, wire.ItemResult(item=i, status="aborted", num_tokens=3), 2.0)
            assert isinstance(out, RoutedResult) and out.result.status == "aborted"
    graph.check()
    withdrawn = [e for e in graph.of(ev.ItemsWithdrawn) if isinstance(e, ev.ItemsWithdrawn)]
    assert sorted(i for e in withdrawn for i in e.items) == leaving
    assert p.pending == set(graph.graph.edges[PROMPTS].items)
    assert len(p.pending) == 1 and graph.graph.edges[PROMPTS].num_withdrawn == 7
    assert not p.withdrawing
    # The item that had generated 5 tokens leaves with them (and 3 more if it ran again).
    carried = 8 if first in in_flight_leaving else 5
    assert _withdrawn_tokens(graph)[first] == carried
    assert not p.generated_tokens, "the placement forgets what left"
    # Back in the next iteration, stating its partial output: enqueued with its
    # progress, completed with all of it.
    graph.events.clear()
    p.admit([item(first.removeprefix("i"), generated=carried)], 3.0)
    enq = graph.of(ev.ItemsEnqueued)
    assert isinstance(enq[0], ev.ItemsEnqueued) and enq[0].generated == (carried,)
    holder = next(w for w in (a, b) if any(it.id == first for it in w.queue.queued()))
    start(holder)
    p.on_result(holder, wire.ItemResult(item=first, num_tokens=4), 4.0)
    done = [e for e in graph.of(ev.ItemCompleted) if isinstance(e, ev.ItemCompleted)]
    assert done[-1].item == first and done[-1].num_tokens == carried + 4
    graph.check()


async def test_an_item_that_finishes_before_its_abort_lands_completes() -> None:
    p, graph, recalls, a, b = _setup()
    p.admit([item(0)], 0.0)
    start(a)
    start(b)
    holder = a if a.in_flight else b
    assert p.withdraw([ItemId("i0")], 1.0) == []
    assert recalls.asked == [(holder.instance, (ItemId("i0"),))]
    out = p.on_result(holder, wire.ItemResult(item=ItemId("i0"), num_tokens=9), 1.1)
    assert out is not None and out.result.status == "done"
    assert not p.withdrawing and not p.generated_tokens and not p.pending
    assert len(graph.of(ev.ItemCompleted)) == 1 and not graph.of(ev.ItemsWithdrawn)
    graph.check()


async def test_sessions_out_on_a_tool_and_backlogged_items_leave_at_once() -> None:
    graph = CheckedGraph(["a"])
    p = Placement({PROMPTS: (ROLLOUT,)}, policy=AffinityRouting(seed=0), emit=graph)
    p.admit([item(k, affinity="prefer") for k in range(3)], 0.0)  # no worker: backlog
    a = worker("a", 1)
    p.add_worker(a, 0.0)
    start(a)
    p.on_result(a, wire.ItemResult(item=ItemId("i0"), status="tool_call", num_tokens=6), 1.0)
    assert ItemId("i0") in p.in_tool
    taken = p.withdraw([ItemId("i0"), ItemId("i1"), ItemId("i2")], 2.0)
    assert {it.id for it in taken} == {ItemId("i0"), ItemId("i1"), ItemId("i2")}
    assert not p.pending and not p.in_tool and not p.backlog and not len(a.queue)
    assert _withdrawn_tokens(graph) == {ItemId("i0"): 6, ItemId("i1"): 0, ItemId("i2"): 0}
    with pytest.raises(RoutingError, match="not out on a tool call"):
        p.resume(ItemId("i0"), b"", 3.0, latency_s=0.1, ok=True)
    graph.check()


async def test_withdrawing_what_is_not_pending_or_cannot_be_recalled_is_refused() -> None:
    graph = CheckedGraph(["a"])
    p = Placement({PROMPTS: (ROLLOUT,)}, policy=AffinityRouting(seed=0), emit=graph)
    a = worker("a", 1)
    p.add_worker(a, 0.0)
    p.admit([item(0)], 0.0)
    start(a)
    with pytest.raises(RoutingError, match="not pending"):
        p.withdraw([ItemId("nope")], 1.0)
    with pytest.raises(RoutingError, match="cannot recall"):
        p.withdraw([ItemId("i0")], 1.0)
    assert p.pending == {ItemId("i0")}
    graph.check()


async def test_a_failed_workers_recalled_items_leave_instead_of_running_elsewhere() -> None:
    p, graph, _, a, b = _setup()
    p.admit([item(k) for k in range(4)], 0.0)
    start(a)
    start(b)
    on_a = list(a.in_flight)
    p.withdraw(on_a, 1.0)
    since = len(graph.events)
    p.fail_worker(a, "lost", 1.5)
    assert set(_withdrawn_tokens(graph)) == set(on_a)
    assert not any(isinstance(e, ev.ItemRouted) for e in graph.events[since:])
    assert p.pending == set(b.in_flight)
    graph.check()


async def test_a_refused_withdrawal_leaves_queued_items_where_they_were() -> None:
    graph = CheckedGraph(["a"])
    p = Placement({PROMPTS: (ROLLOUT,)}, policy=AffinityRouting(seed=0), emit=graph)
    a = worker("a", 1)
    p.add_worker(a, 0.0)
    p.admit([item(0), item(1)], 0.0)
    start(a)  # i0 runs, i1 waits in a's queue
    with pytest.raises(RoutingError, match="cannot recall"):
        p.withdraw([ItemId("i0"), ItemId("i1")], 1.0)
    assert [it.id for it in a.queue.queued()] == [ItemId("i1")]
    assert p.pending == {ItemId("i0"), ItemId("i1")} and not graph.of(ev.ItemsWithdrawn)
    graph.check()
