"""The hypergraph's invariants, verified from scratch (for tests and debugging)."""

import math

from dynarl.control.elements import TOOL
from dynarl.control.graph_state import GraphState
from dynarl.core.errors import InvariantError
from dynarl.core.ids import DeviceId


def check_invariants(graph: GraphState) -> None:
    """Verify every invariant from scratch; raises :class:`InvariantError`.

    A device is held by at most one instance or migration, or is free; device
    counts are conserved; every pending item is held by exactly one consumer
    instance, the tool stage, or its edge's queue; cached counters agree, the
    rollout progress sums included.
    """
    seen: dict[DeviceId, str] = {}

    def claim(d: DeviceId, who: str) -> None:
        if d in seen:
            raise InvariantError(f"device {d} is in {seen[d]} and in {who}")
        if not 0 <= d < graph.num_devices:
            raise InvariantError(f"device {d} is outside the cluster ({who})")
        seen[d] = who

    for node in graph.instances.values():
        for d in node.devices:
            claim(d, f"instance {node.id}")
            if graph.device_owner.get(d) != node.id:
                raise InvariantError(f"device_owner[{d}] is not {node.id}")
    for m in graph.migrations.values():
        for d in m.devices:
            if graph.device_owner.get(d) == m.id:
                claim(d, f"migration {m.id}")
    for d in graph.free_devices:
        claim(d, "the free pool")
    if len(seen) != graph.num_devices:
        lost = sorted(set(range(graph.num_devices)) - set(seen))
        raise InvariantError(f"devices {lost} are held by nobody: device count not conserved")
    if not graph.crashed_devices <= graph.free_devices:
        raise InvariantError("a crashed device is not in the free pool")
    in_migrations = {d for m in graph.migrations.values() for d in m.devices}
    if not graph.crashed_in_migration <= in_migrations:
        raise InvariantError("a device crashed in a migration that no longer holds it")
    if len(graph.device_owner) + len(graph.free_devices) != graph.num_devices:
        raise InvariantError("device_owner holds stale entries")
    for hn in graph.components.values():
        active = [n for n in hn.instances.values() if n.state == "active"]
        if hn.num_active != len(active):
            raise InvariantError(f"{hn.id}: num_active {hn.num_active} != {len(active)}")
        if hn.num_active_devices != sum(len(n.devices) for n in active):
            raise InvariantError(f"{hn.id}: num_active_devices out of date")
        for n in hn.instances.values():
            if graph.instances.get(n.id) is not n or n.component != hn.id:
                raise InvariantError(f"instance {n.id} is filed under the wrong component")
    for node in graph.instances.values():
        for item, edge_id in node.items.items():
            st = graph.edges[edge_id].items.get(item)
            if st is None or st.owner != node.id:
                raise InvariantError(f"{node.id} holds {item!r}, which it does not own")
    for edge in graph.edges.values():
        in_tool = 0
        turns: dict[int, int] = {}
        for st in edge.items.values():
            if st.owner is None:
                if st.id not in edge.queue:
                    raise InvariantError(f"{st.id!r} on {edge.id} is owned by nobody")
            elif st.owner == TOOL:
                in_tool += 1
                if edge.in_tool.get(st.id) is not st:
                    raise InvariantError(f"{st.id!r} is in a tool, not in {edge.id}'s sessions")
                turns[st.tool_calls + 1] = turns.get(st.tool_calls + 1, 0) + 1
            else:
                holder = graph.instances.get(st.owner)
                if holder is None or holder.items.get(st.id) != edge.id:
                    raise InvariantError(f"{st.id!r} on {edge.id} claims owner {st.owner}")
                if holder.component not in edge.spec.consumers:
                    raise InvariantError(f"{st.owner} holds {st.id!r}, not a consumer")
                if st.id in edge.queue:
                    raise InvariantError(f"{st.id!r} is both queued and held by {st.owner}")
        if any(i not in edge.items for i in edge.queue):
            raise InvariantError(f"{edge.id} queue holds completed items")
        if in_tool != edge.num_in_tool:
            raise InvariantError(f"{edge.id}: num_in_tool {edge.num_in_tool} != {in_tool}")
        if turns != edge.in_tool_turns:
            raise InvariantError(f"{edge.id}: in_tool_turns {edge.in_tool_turns} != {turns}")
        if edge.num_enqueued != edge.num_completed + edge.num_withdrawn + len(edge.items):
            raise InvariantError(f"{edge.id}: enqueued != completed + withdrawn + pending")
        groups: dict[object, list[int]] = {}
        for st in edge.items.values():
            g = groups.setdefault(st.group, [0, 0])
            g[0] += 1
            g[1] += max(st.tokens, 1)
        if groups != edge.groups:
            raise InvariantError(f"{edge.id}: per-group counts out of date")
        sizes = sum(max(st.tokens, 1) for st in edge.items.values())
        if edge.tokens_pending != sizes:
            raise InvariantError(f"{edge.id}: tokens_pending {edge.tokens_pending} != {sizes}")
        parked = sum(st.generated for st in edge.items.values() if st.owner in (None, TOOL))
        if not math.isclose(edge.progress_parked, parked, rel_tol=1e-9, abs_tol=1e-3):
            raise InvariantError(f"{edge.id}: progress_parked {edge.progress_parked} != {parked}")
    for node in graph.instances.values():
        base, started, waiting = 0.0, 0, set()
        for item, edge_id in node.items.items():
            st = graph.edges[edge_id].items[item]
            base += st.generated - (st.mark if st.running else 0.0)
            started += st.running
            if not st.running:
                waiting.add(item)
        if started != len(node.started) or waiting != set(node.waiting):
            raise InvariantError(f"{node.id}: running/waiting items out of date")
        if not math.isclose(node.progress_base, base, rel_tol=1e-9, abs_tol=1e-3):
            raise InvariantError(f"{node.id}: progress_base {node.progress_base} != {base}")
