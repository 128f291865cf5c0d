"""Item flow in the hypergraph: which queue, instance or tool holds each item, and what
its moves count.

Every item pending on a hyperedge is held by exactly one of the edge's queue, a
consumer instance, or the tool stage (a multi-turn session out of its engine while its
environment runs). This module holds the handlers that move items between them --
:class:`~dynarl.control.events.ItemsEnqueued`, :class:`~dynarl.control.events.ItemRouted`,
:class:`~dynarl.control.events.ItemsRequeued`,
:class:`~dynarl.control.events.ItemsWithdrawn`,
:class:`~dynarl.control.events.ToolCallStarted`,
:class:`~dynarl.control.events.ToolCallFinished` and
:class:`~dynarl.control.events.ItemCompleted`, which :class:`Hypergraph` registers in its
handler table -- and :func:`release`, with which removing an instance returns its items
to their queues. Each also keeps the counters that follow the items: the edge's progress
and token counts, its groups and sessions in a tool, and the consumer's completions,
response lengths and occupied time.

Like every handler, each validates before it mutates: a rejected event
(:class:`EventError`) changes nothing.
"""

from typing import Protocol

from dynarl.control import events as ev
from dynarl.control.elements import TOOL, HyperEdge, ItemState, Node
from dynarl.control.graph_state import GraphState
from dynarl.core.errors import EventError
from dynarl.core.ids import EdgeId, GroupId, ItemId


class ItemGraph(GraphState, Protocol):
    """The hypergraph as the item handlers see it: its state, whether items carry
    sizes, and a partial rollout's due groups."""

    sized: bool
    """Whether items carry sizes: set by the first sized item enqueued."""

    groups_due: frozenset[GroupId]
    """The groups a partial rollout completes whatever else does (not counted done)."""

    def item_work(self, item: ItemState) -> float:
        """Work ``item`` is to a stage after rollout."""


def on_items_enqueued(graph: ItemGraph, e: ev.ItemsEnqueued) -> None:
    """Queue new items on their edge."""
    edge = _edge(graph, e.edge)
    ids = [ref.id for ref in e.items]
    dup = next((i for i in ids if i in edge.items), None)
    if dup is not None or len(set(ids)) != len(ids):
        raise EventError(f"item {dup!r} enqueued twice on edge {edge.id!r}")
    for ref in e.items:
        if ref.tokens < 0:
            raise EventError(f"item {ref.id!r} has a negative size ({ref.tokens} tokens)")
    _check_generated(e.generated, len(ids), "enqueue")
    for ref in e.items:
        edge.items[ref.id] = ItemState(ref.id, ref.group, e.time_s, ref.tokens)
        edge.queue[ref.id] = None
        edge.tokens_pending += max(ref.tokens, 1)
        group = edge.groups.setdefault(ref.group, [0, 0])
        group[0] += 1
        group[1] += max(ref.tokens, 1)
        graph.sized = graph.sized or ref.tokens > 0
    for ref, generated in zip(e.items, e.generated, strict=False):
        edge.items[ref.id].generated = float(generated)
        edge.progress_parked += generated
    edge.num_enqueued += len(e.items)
    edge.enqueued_this_iteration += len(e.items)


def on_item_routed(graph: ItemGraph, e: ev.ItemRouted) -> None:
    """Move a queued item to the consumer instance it was routed to."""
    edge = _edge(graph, e.edge)
    item = _item(edge, e.item)
    node = graph._instance(e.instance)
    if item.owner is not None:
        raise EventError(f"{e.item!r} routed to {e.instance!r} but {item.owner!r} holds it")
    if node.component not in edge.spec.consumers:
        raise EventError(f"{e.instance!r} does not consume edge {edge.id!r}")
    # A draining instance may still be routed to: the data plane hears of a drain
    # after the controller commits it (the executor carries it out), and an item it
    # routes meanwhile is on that instance until the drain hands it back
    # (``ItemsRequeued``) or the migration ends (then it is requeued here).
    del edge.queue[e.item]
    item.owner = item.last_instance = e.instance
    if not node.items:
        node.held_since_s = e.time_s
    node.items[e.item] = edge.id
    edge.progress_parked -= item.generated
    node.attach(item)
    node.busy = True
    edge.num_routed += 1


def on_items_requeued(graph: ItemGraph, e: ev.ItemsRequeued) -> None:
    """Return items an instance handed back to their edge's queue, with the progress
    each had made."""
    edge = _edge(graph, e.edge)
    states = [_item(edge, i) for i in e.items]
    for st in states:
        if st.owner is None or st.owner == TOOL:
            raise EventError(f"item {st.id!r} requeued but no instance holds it")
    _check_generated(e.generated, len(states), "requeue")
    for st in states:
        release(graph, edge, st, e.time_s)
    for st, generated in zip(states, e.generated, strict=False):
        edge.progress_parked += generated - st.generated
        st.generated = float(generated)


def on_items_withdrawn(graph: ItemGraph, e: ev.ItemsWithdrawn) -> None:
    """Take unfinished items off their edge without completing them (a partial
    rollout's iteration ended; they carry over): from the queue, the instance holding
    them or the tool stage. Nothing is counted as completed."""
    edge = _edge(graph, e.edge)
    states = [_item(edge, i) for i in e.items]
    if len({st.id for st in states}) != len(states):
        raise EventError(f"an item is withdrawn twice from edge {edge.id!r}")
    _check_generated(e.generated, len(states), "withdrawal")
    for st in states:
        if st.owner is None:
            del edge.queue[st.id]
            edge.progress_parked -= st.generated
        elif st.owner == TOOL:
            edge.progress_parked -= st.generated
            _leave_tool(edge, st)
        else:
            _take(graph, graph.instances[st.owner], st, e.time_s)
        _forget(edge, st)
    edge.num_withdrawn += len(states)


def release(graph: ItemGraph, edge: HyperEdge, st: ItemState, time_s: float) -> None:
    """Move an item from its instance back to the edge's queue."""
    assert st.owner is not None and st.owner != TOOL
    _take(graph, graph.instances[st.owner], st, time_s)
    st.owner = None
    edge.queue[st.id] = None
    edge.progress_parked += st.generated
    edge.num_requeued += 1


def on_item_completed(graph: ItemGraph, e: ev.ItemCompleted) -> None:
    """Retire a completed item and count it to its consumer."""
    edge = _edge(graph, e.edge)
    st = _item(edge, e.item)
    if st.owner == TOOL and st.last_instance == e.instance:
        # A multi-turn session its environment ended while it was out of its
        # engine: it completes where it last ran.
        edge.progress_parked -= st.generated
        component = edge.spec.consumers[0]  # its engine may have left meanwhile
        _count(graph.components[component].tool_ends, _leave_tool(edge, st))
    elif st.owner != e.instance:
        raise EventError(f"{e.instance!r} completed {e.item!r} but {st.owner!r} holds it")
    else:
        node = graph.instances[e.instance]
        component = node.component
        if graph.components[component].spec.kind == "rollout":
            node.settle(st, e.num_tokens)
        _take(graph, node, st, e.time_s)
    _forget(edge, st)
    if st.group not in edge.groups and st.group not in graph.groups_due:
        edge.groups_done_this_iteration += 1
    edge.num_completed += 1
    edge.tokens_completed += e.num_tokens
    hn = graph.components[component]
    hn.work_completed += e.num_tokens if hn.spec.kind == "rollout" else graph.item_work(st)
    hn.items_completed += 1
    hn.tokens_completed += e.num_tokens
    hn.tokens_completed_iter += e.num_tokens
    hn.items_completed_iter += 1
    hn.max_tokens_iter = max(hn.max_tokens_iter, e.num_tokens)
    if hn.spec.kind == "rollout":
        hn.lengths_iter.append(e.num_tokens)
        if hn.group_max_iter.get(st.group, -1) < e.num_tokens:
            hn.group_max_iter[st.group] = e.num_tokens
    if hn.spec.kind != "rollout":  # rollout's rate comes from engine stats
        hn.work_rate.add(e.time_s, 1.0)


def on_tool_call_started(graph: ItemGraph, e: ev.ToolCallStarted) -> None:
    """Move an item from its instance to the tool stage."""
    edge = _edge(graph, e.edge)
    st = _item(edge, e.item)
    if st.owner != e.instance:
        raise EventError(f"{e.instance!r} started a tool for {e.item!r} held by {st.owner!r}")
    _take(graph, graph.instances[e.instance], st, e.time_s)
    st.owner = TOOL
    edge.progress_parked += st.generated
    st.prefix_tokens = e.prefix_tokens
    edge.in_tool[st.id] = st
    turns = st.tool_calls + 1
    edge.in_tool_turns[turns] = edge.in_tool_turns.get(turns, 0) + 1


def on_tool_call_finished(graph: ItemGraph, e: ev.ToolCallFinished) -> None:
    """Return an item from the tool stage to its edge's queue for its next turn."""
    edge = _edge(graph, e.edge)
    st = _item(edge, e.item)
    if st.owner != TOOL:
        raise EventError(f"tool call finished for {e.item!r}, which is not in a tool")
    st.owner = None
    _count(graph.components[edge.spec.consumers[0]].tool_returns, _leave_tool(edge, st))
    st.tool_calls += 1
    edge.queue[e.item] = None


def _take(graph: ItemGraph, node: Node, st: ItemState, time_s: float) -> None:
    """Remove ``st`` from ``node``; close its occupied span if it holds no more."""
    node.detach(st)
    del node.items[st.id]
    if not node.items and node.held_since_s is not None:
        hn = graph.components[node.component]
        hn.occupied_s += max(0.0, time_s - node.held_since_s)
        node.held_since_s = None


def _forget(edge: HyperEdge, st: ItemState) -> None:
    """Take ``st`` off ``edge``'s items, its group and its pending tokens."""
    del edge.items[st.id]
    group = edge.groups[st.group]
    if group[0] == 1:
        del edge.groups[st.group]
    else:
        group[0] -= 1
        group[1] -= max(st.tokens, 1)
    edge.tokens_pending -= max(st.tokens, 1)


def _check_generated(generated: tuple[int, ...], num_items: int, what: str) -> None:
    """Raise unless ``generated`` is empty or one non-negative count per item."""
    if generated and (len(generated) != num_items or min(generated) < 0):
        raise EventError(
            f"{what} of {num_items} items reports {len(generated)} progress counts "
            "(give one non-negative count per item, or none)"
        )


def _edge(graph: ItemGraph, edge: EdgeId) -> HyperEdge:
    try:
        return graph.edges[edge]
    except KeyError:
        raise EventError(f"unknown edge {edge!r}") from None


def _item(edge: HyperEdge, item: ItemId) -> ItemState:
    try:
        return edge.items[item]
    except KeyError:
        raise EventError(f"item {item!r} is not pending on edge {edge.id!r}") from None


def _leave_tool(edge: HyperEdge, st: ItemState) -> int:
    """Take ``st`` off ``edge``'s sessions in a tool; the turns it had done."""
    del edge.in_tool[st.id]
    turns = st.tool_calls + 1
    left = edge.in_tool_turns[turns] - 1
    if left:
        edge.in_tool_turns[turns] = left
    else:
        del edge.in_tool_turns[turns]
    return turns


def _count(counts: list[int], k: int) -> None:
    """Add one at index ``k`` of ``counts``, growing it as needed."""
    if len(counts) <= k:
        counts.extend([0] * (k + 1 - len(counts)))
    counts[k] += 1
