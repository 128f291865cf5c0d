"""Device placement in the hypergraph: which instance, migration or pool holds each device.

The hypergraph keeps the placement state (``instances``, ``device_owner``,
``free_devices``, ``crashed_devices``, ``crashed_in_migration``, ``migrations``,
``next_migration_id`` and the per-component instance serials behind
:meth:`Hypergraph.new_instance_id`); this module holds the code that changes it: the
initial placement, instance creation and removal, and the handlers for
:class:`~dynarl.control.events.MigrationStarted`, :class:`~dynarl.control.events.MigrationDone`,
:class:`~dynarl.control.events.MigrationFailed` and
:class:`~dynarl.control.events.WorkerFailed`, which :class:`Hypergraph` registers in its
handler table.

Like every handler, each validates before it mutates: a rejected event
(:class:`EventError`) changes nothing. Removing an instance returns the items it held to
their queues through the hypergraph's item bookkeeping (``Hypergraph._release``).
"""

from collections.abc import Iterable, Mapping

import msgspec

from dynarl.control import events as ev
from dynarl.control.elements import Node
from dynarl.control.graph_state import GraphState
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.topology import ComponentSpec
from dynarl.core.errors import EventError
from dynarl.core.ids import ComponentId, DeviceId, MigrationId


def place_initial(
    graph: GraphState, placement: Mapping[ComponentId, Iterable[InstanceSpec]]
) -> None:
    """Create the initial instances per component; devices not placed stay free."""
    for cid, instances in placement.items():
        if cid not in graph.components:
            raise EventError(f"placement names unknown component {cid!r}")
        for inst in instances:
            check_new_instance(graph, inst, graph.components[cid].spec)
            for d in inst.devices:
                if d not in graph.free_devices:
                    raise EventError(f"placement puts device {d} in two instances")
                graph.free_devices.discard(d)
            add_instance(graph, inst, cid)


def on_migration_started(graph: GraphState, e: ev.MigrationStarted) -> None:
    """Drain the migration's instances and move its free devices into transit."""
    m = e.migration
    if m.id in graph.migrations:
        raise EventError(f"migration {m.id} started twice")
    drained = [graph._instance(i) for i in m.drain]
    for node in drained:
        if node.component != m.src or node.state != "active":
            raise EventError(f"migration {m.id} drains {node.id!r}: not an active {m.src}")
    from_instances = {d for n in drained for d in n.devices}
    from_free = set(m.devices) - from_instances
    if len(set(m.devices)) != len(m.devices) or not from_instances <= set(m.devices):
        raise EventError(f"migration {m.id}: devices disagree with its drained instances")
    if not from_free <= graph.free_devices:
        taken = sorted(from_free - graph.free_devices)
        raise EventError(f"migration {m.id} takes devices {taken} that are not free")
    created = [d for spec in m.create for d in spec.devices]
    if len(set(created)) != len(created) or not set(created) <= set(m.devices):
        raise EventError(f"migration {m.id} creates instances on devices it does not move")
    resized = _resized(graph, m)
    if m.create:
        if m.dst is None:
            raise EventError(f"migration {m.id} creates instances in the free pool")
        dst = graph.components[m.dst].spec
        if resized:
            dst = msgspec.structs.replace(dst, devices_per_instance=m.unit)
        for spec in m.create:
            check_new_instance(graph, spec, dst)
    if resized and m.dst is not None:
        graph.components[m.dst].resize(m.unit)
    for node in drained:
        node.state = "draining"
        hn = graph.components[node.component]
        hn.num_active -= 1
        hn.num_active_devices -= len(node.devices)
    if drained and m.src is not None:
        # A measured rate belongs to a device count: what the component did on its
        # old devices must not be read as the rate of its new ones.
        graph.components[m.src].restart_rate(e.time_s)
    for d in from_free:
        graph.free_devices.discard(d)
        graph.crashed_devices.discard(d)
        graph.device_owner[d] = m.id
    if m.dst is not None:
        # Reserve the new ids now, so the next plan does not reuse them.
        graph._instance_serial[m.dst] += len(m.create)
    graph.migrations[m.id] = m
    graph.next_migration_id = MigrationId(max(graph.next_migration_id, m.id + 1))


def _resized(graph: GraphState, m: Migration) -> bool:
    """Whether ``m`` resizes its destination's instances; raise :class:`EventError` if
    it may not (a size the spec does not allow, or active instances of the old size
    left that it does not drain)."""
    if not m.unit or m.dst is None or m.unit == graph.components[m.dst].spec.devices_per_instance:
        return False
    hn = graph.components[m.dst]
    if m.unit not in hn.base_spec.instance_sizes:
        raise EventError(
            f"migration {m.id} resizes {m.dst} to {m.unit} devices an instance; "
            f"its instances take {hn.base_spec.instance_sizes}"
        )
    left = sorted({n.id for n in hn.active_instances()} - set(m.drain))
    if left:
        raise EventError(f"migration {m.id} resizes {m.dst} but leaves {left} as they are")
    return True


def on_migration_done(graph: GraphState, e: ev.MigrationDone) -> None:
    """Remove the drained instances, place the new ones, free the remaining devices."""
    m = _migration(graph, e.migration)
    del graph.migrations[m.id]
    for iid in m.drain:
        if iid in graph.instances:  # a drained instance may have failed meanwhile
            remove_instance(graph, graph.instances[iid], e.time_s)
    for d in m.devices:
        if graph.device_owner.get(d) == m.id:
            del graph.device_owner[d]
    placed: set[DeviceId] = set()
    for spec in m.create:
        assert m.dst is not None
        add_instance(graph, spec, m.dst, e.time_s)
        placed.update(spec.devices)
    if m.create and m.dst is not None:
        graph.components[m.dst].restart_rate(e.time_s)  # resized: see on_migration_started
    if m.src is not None:
        # A component left without instances starts again at its own size (the
        # rollout's engines regrouped for a tail; a move may start the next ones wide).
        src = graph.components[m.src]
        if not src.instances and src.spec is not src.base_spec:
            src.resize(src.base_spec.devices_per_instance)
    _free(graph, [d for d in m.devices if d not in placed])
    graph.crashed_in_migration.difference_update(m.devices)


def on_migration_failed(graph: GraphState, e: ev.MigrationFailed) -> None:
    """Put the drained instances back to work and return the migration's free devices."""
    m = _migration(graph, e.migration)
    del graph.migrations[m.id]
    for iid in m.drain:
        node = graph.instances.get(iid)
        if node is not None and node.state == "draining":
            node.state = "active"
            hn = graph.components[node.component]
            hn.num_active += 1
            hn.num_active_devices += len(node.devices)
            if m.unit:
                hn.resize(len(node.devices))  # back to the size of those it restarts
    if m.unit and m.dst is not None:
        # A component a failed move was to start at another size: back to its own.
        dst = graph.components[m.dst]
        if not dst.num_active and dst.spec is not dst.base_spec:
            dst.resize(dst.base_spec.devices_per_instance)
    if m.drain and m.src is not None:
        graph.components[m.src].restart_rate(e.time_s)  # resized back
    for d in m.devices:
        if graph.device_owner.get(d) == m.id:
            del graph.device_owner[d]
            _free(graph, [d])
    graph.crashed_in_migration.difference_update(m.devices)


def _free(graph: GraphState, devices: Iterable[DeviceId]) -> None:
    """Return ``devices`` to the free pool; those whose instance crashed during the
    migration that held them are marked crashed (the scheduler reboots them)."""
    for d in devices:
        graph.free_devices.add(d)
        if d in graph.crashed_in_migration:
            graph.crashed_devices.add(d)


def on_worker_failed(graph: GraphState, e: ev.WorkerFailed) -> None:
    """Forget a crashed instance; its devices go to its migration or, marked crashed,
    to the free pool."""
    node = graph._instance(e.instance)
    if node.state == "active":
        hn = graph.components[node.component]
        hn.num_active -= 1
        hn.num_active_devices -= len(node.devices)
    remove_instance(graph, node, e.time_s)
    migration = next((m for m in graph.migrations.values() if node.id in m.drain), None)
    if migration is not None:
        # A draining instance's devices already belong to its migration; if it
        # leaves them free, they are crashed (see _free).
        graph.device_owner.update(dict.fromkeys(node.devices, migration.id))
        graph.crashed_in_migration.update(node.devices)
    else:
        # The devices go back to the pool: the scheduler may reboot an instance there.
        graph.free_devices.update(node.devices)
        graph.crashed_devices.update(node.devices)


def check_new_instance(graph: GraphState, spec: InstanceSpec, component: ComponentSpec) -> None:
    """Raise :class:`EventError` unless ``spec`` is a new, well-sized ``component`` instance."""
    if spec.id in graph.instances:
        raise EventError(f"instance {spec.id!r} already exists")
    if len(spec.devices) != component.devices_per_instance:
        raise EventError(
            f"instance {spec.id!r} has {len(spec.devices)} devices; "
            f"{component.id} instances take {component.devices_per_instance}"
        )


def add_instance(
    graph: GraphState, spec: InstanceSpec, component: ComponentId, time_s: float | None = None
) -> None:
    """Create an active instance of ``component`` holding ``spec``'s devices."""
    node = Node(spec, component, graph.now_s if time_s is None else time_s)
    graph.instances[spec.id] = node
    hn = graph.components[component]
    hn.instances[spec.id] = node
    hn.num_active += 1
    hn.num_active_devices += len(spec.devices)
    for d in spec.devices:
        graph.device_owner[d] = spec.id
    serial = spec.id.rsplit("-", 1)[-1]
    if serial.isdigit():
        graph._instance_serial[component] = max(graph._instance_serial[component], int(serial) + 1)


def remove_instance(graph: GraphState, node: Node, time_s: float) -> None:
    """Forget an instance; items it still held go back to their queues."""
    for item, edge_id in list(node.items.items()):
        graph._release(graph.edges[edge_id], graph.edges[edge_id].items[item], time_s)
    for d in node.devices:
        if graph.device_owner.get(d) == node.id:
            del graph.device_owner[d]
    del graph.instances[node.id]
    del graph.components[node.component].instances[node.id]


def _migration(graph: GraphState, mid: MigrationId) -> Migration:
    try:
        return graph.migrations[mid]
    except KeyError:
        raise EventError(f"unknown migration {mid}") from None
