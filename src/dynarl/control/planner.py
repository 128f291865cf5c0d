"""Instance-level scheduling: turn "move k devices from A to B" into a concrete plan.

:class:`PlanBuilder` decides which instances to drain (fewest running requests first),
which devices the new instances get (whole scaling units, devices kept in order so a
tensor-parallel group stays on neighbouring devices), where the drained instances'
items go (largest groups first to the least-loaded remaining instance; a hot engine's
requests one by one, see :meth:`PlanBuilder.spread`), and which actor sizes are
allowed. It reads the hypergraph and never changes it; migrations
added to one builder never reuse a device or an instance id.
"""

import heapq
from collections import defaultdict
from collections.abc import Sequence

from dynarl.control.elements import Node
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec, Migration, MigrationKind, Plan
from dynarl.core.ids import ComponentId, DeviceId, GroupId, InstanceId, ItemId, MigrationId


def migration_kind(
    src: ComponentId | None, dst: ComponentId | None, graph: Hypergraph
) -> MigrationKind:
    """Trainer state moves peer to peer (``reshard``); everything else moves its
    requests (``workload``)."""
    for end in (src, dst):
        if end is not None and graph.components[end].spec.kind == "actor":
            return "reshard"
    return "workload"


def drain_order(instances: list[Node]) -> list[Node]:
    """Instances in the order they should be released: fewest items in flight first,
    then lowest KV usage, then id (for determinism)."""
    return sorted(instances, key=lambda n: (len(n.items), n.num_running, n.kv_usage, n.id))


def redistribute(
    groups: dict[GroupId, list[ItemId]], loads: dict[InstanceId, int]
) -> list[tuple[ItemId, InstanceId]]:
    """Assign whole groups to instances: largest group first to the least-loaded
    instance (LPT). ``loads`` is each destination's current item count."""
    if not loads:
        return []
    heap = [(load, iid) for iid, load in sorted(loads.items())]
    heapq.heapify(heap)
    out: list[tuple[ItemId, InstanceId]] = []
    for group in sorted(groups, key=lambda g: (-len(groups[g]), g)):
        load, iid = heapq.heappop(heap)
        out.extend((item, iid) for item in groups[group])
        heapq.heappush(heap, (load + len(groups[group]), iid))
    return out


class PlanBuilder:
    """Accumulates migrations for one decision against one hypergraph snapshot."""

    def __init__(
        self,
        graph: Hypergraph,
        *,
        reassign: bool = True,
        orders: dict[ComponentId, list[Node]] | None = None,
    ) -> None:
        self.graph = graph
        self.reassign = reassign  # candidates being scored can skip it: O(items)
        self.migrations: list[Migration] = []
        self._used_devices: set[DeviceId] = set()
        self._drained: set[InstanceId] = set()
        self._num_drained: dict[ComponentId, int] = defaultdict(int)
        # Each component's drain order; builders of one decision may share it.
        self._order: dict[ComponentId, list[Node]] = {} if orders is None else orders
        self._created: dict[ComponentId, int] = defaultdict(int)
        self._free = sorted(graph.free_devices)

    # ---------------------------------------------------------------- sizes

    def instances(self, component: ComponentId) -> int:
        """Active instances ``component`` will have after the migrations so far."""
        node = self.graph.components[component]
        return node.num_active - self._num_drained[component] + self._created[component]

    def free_devices(self) -> list[DeviceId]:
        """Free devices not yet taken by this plan."""
        return [d for d in self._free if d not in self._used_devices]

    def drainable(self, component: ComponentId, limit: int | None = None) -> list[Node]:
        """Active instances of ``component`` not yet drained, in drain order (the first
        ``limit`` of them, if given)."""
        order = self._order.get(component)
        if order is None:
            order = drain_order(list(self.graph.components[component].active_instances()))
            self._order[component] = order
        if not self._drained:
            return order[:limit]  # a copy (the order is shared)
        out = [n for n in order if n.id not in self._drained]
        return out if limit is None else out[:limit]

    def shrink_targets(self, component: ComponentId) -> list[int]:
        """Instance counts ``component`` may shrink to, largest first."""
        spec = self.graph.components[component].spec
        now = self.instances(component)
        if spec.valid_sizes:  # only those (and 0) can be valid
            sizes = sorted({*spec.valid_sizes, 0}, reverse=True)
            return [k for k in sizes if k < now and spec.is_valid_size(k)]
        return [k for k in range(now - 1, -1, -1) if spec.is_valid_size(k)]

    def shrink_target(self, component: ComponentId, at_most: int) -> int | None:
        """The largest count ``component`` may shrink to that is at most ``at_most``
        (the largest of :meth:`shrink_targets` not above it), or ``None``."""
        spec = self.graph.components[component].spec
        top = min(self.instances(component) - 1, at_most)
        if spec.valid_sizes:  # only those (and 0) can be valid
            return max(
                (k for k in {*spec.valid_sizes, 0} if k <= top and spec.is_valid_size(k)),
                default=None,
            )
        for k in range(top, -1, -1):
            if spec.is_valid_size(k):
                return k
        return None

    def grow_target(self, component: ComponentId, extra_devices: int, unit: int = 0) -> int:
        """The largest valid instance count reachable with ``extra_devices`` more (as
        instances of ``unit`` devices; 0: the component's size now)."""
        spec = self.graph.components[component].spec
        now = self.instances(component)
        top = now + extra_devices // (unit or spec.devices_per_instance)
        if spec.valid_sizes:  # only those can be valid
            return max(
                (k for k in spec.valid_sizes if now < k <= top and spec.is_valid_size(k)),
                default=now,
            )
        best = now
        for k in range(now + 1, top + 1):
            if spec.is_valid_size(k):
                best = k
        return best

    # ---------------------------------------------------------------- building

    def move(
        self,
        src: ComponentId | None,
        dst: ComponentId | None,
        *,
        drain: int = 0,
        take_free: int | Sequence[DeviceId] = 0,
        create: int | None = None,
        unit: int = 0,
    ) -> Migration | None:
        """Drain ``drain`` instances of ``src`` (in drain order) plus ``take_free``
        free devices (a count, or the devices themselves), and start ``create``
        instances of ``dst`` on them (by default as many as fit and keep ``dst`` at a
        valid size). Returns ``None`` when that moves nothing.

        ``unit`` starts ``dst``'s instances at that many devices each, one of its
        spec's ``instance_sizes`` (a resize: see ``Migration.unit``); ``dst`` may then
        have no instance, active or made by this builder, of its size now."""
        graph = self.graph
        if unit and dst is not None and self.instances(dst):
            raise ValueError(f"{dst} has instances: a move cannot start others at {unit}")
        drained = self.drainable(src, drain) if src is not None and drain else []
        if isinstance(take_free, int):
            free = self.free_devices()[:take_free]
        else:
            available = set(self.free_devices())
            free = [d for d in take_free if d in available]
        devices = sorted({d for n in drained for d in n.devices} | set(free))
        if not devices:
            return None
        specs: list[InstanceSpec] = []
        if dst is not None:
            size = unit or graph.components[dst].spec.devices_per_instance
            if create is None:
                create = self.grow_target(dst, len(devices), unit) - self.instances(dst)
            create = min(create, len(devices) // size)
            for i in range(create):
                iid = graph.new_instance_id(dst, self._created[dst] + i)
                specs.append(
                    InstanceSpec(id=iid, devices=tuple(devices[i * size : (i + 1) * size]))
                )
        reassign: list[tuple[ItemId, InstanceId]] = []
        if drained and src is not None and self.reassign:
            reassign = self._reassign(src, drained)
        kind = migration_kind(src, dst, graph)
        if any(d in graph.crashed_devices for d in free):
            kind = "reboot"  # a crashed worker's device: its process restarts
        migration = Migration(
            id=MigrationId(graph.next_migration_id + len(self.migrations)),
            kind=kind,
            src=src if drained else None,
            dst=dst if specs else None,
            devices=tuple(devices),
            drain=tuple(n.id for n in drained),
            create=tuple(specs),
            reassign=tuple(reassign),
            unit=unit if specs else 0,
        )
        self.migrations.append(migration)
        self._used_devices.update(free)
        self._drained.update(n.id for n in drained)
        if src is not None:
            self._num_drained[src] += len(drained)
        if dst is not None:
            self._created[dst] += len(specs)
        return migration

    def _reassign(self, src: ComponentId, drained: list[Node]) -> list[tuple[ItemId, InstanceId]]:
        groups: dict[GroupId, list[ItemId]] = defaultdict(list)
        for node in drained:
            for item, edge in node.items.items():
                groups[self.graph.edges[edge].items[item].group].append(item)
        leaving = {n.id for n in drained}
        loads = {n.id: len(n.items) for n in self.drainable(src) if n.id not in leaving}
        return redistribute(dict(groups), loads)

    def spread(self, component: ComponentId, hot: Sequence[Node]) -> Migration | None:
        """Drain the engines ``hot`` and restart each on its own devices, spreading
        their requests one by one over the remaining instances, each to the least
        loaded (requests split from their groups: a hot engine is hot because its
        groups are long). Returns ``None`` when that moves no request. A builder made
        with ``reassign=False`` leaves the destinations out (a candidate to score:
        :func:`spread_peak` says how loaded the engines end up)."""
        hot = [n for n in hot if n.id not in self._drained and n.state == "active"]
        leaving = {n.id for n in hot}
        loads = {n.id: len(n.items) for n in self.drainable(component) if n.id not in leaving}
        if not hot or not loads or not any(n.items for n in hot):
            return None
        heap = [(load, iid) for iid, load in sorted(loads.items())]
        heapq.heapify(heap)
        reassign: list[tuple[ItemId, InstanceId]] = []
        # Round-robin over the hot engines, so each destination gets a mix of them.
        queues = [sorted(n.items) for n in hot] if self.reassign else [[]]
        for k in range(max(len(q) for q in queues)):
            for q in queues:
                if k < len(q):
                    load, iid = heapq.heappop(heap)
                    reassign.append((q[k], iid))
                    heapq.heappush(heap, (load + 1, iid))
        return self._restart(component, hot, [n.devices for n in hot], reassign=reassign)

    def regroup(self, component: ComponentId, unit: int) -> Migration | None:
        """Drain every active instance of ``component`` and restart its devices as
        instances of ``unit`` devices each (a resize: see ``Migration.unit``), their
        items back in the queue for the new instances to take. Each new instance takes
        whole drained ones: first every aligned block of ``unit`` devices (``k *
        unit`` on) they fill, then the rest in device order (as a move to a component
        of a larger unit does); the devices of those left over go to the free pool.
        As many instances either way; aligned first, so that the new instances are
        those the real world built at its start, on one node each (an engine is
        built ahead on every aligned group). ``None`` if none would be made."""
        active = sorted(self.graph.components[component].active_instances(), key=_first_device)
        if not active or any(n.id in self._drained for n in active):
            return None
        owner = {d: n.id for n in active for d in n.devices}
        groups: list[tuple[DeviceId, ...]] = []
        placed: set[InstanceId] = set()
        for node in active:
            first = _first_device(node)
            block = tuple(DeviceId(first + k) for k in range(unit))
            members = {owner.get(d) for d in block}
            if first % unit or None in members or not placed.isdisjoint(members):
                continue
            if sum(len(self.graph.instances[m].devices) for m in members if m) == unit:
                groups.append(block)  # whole instances, filling it
                placed.update(m for m in members if m)
        devices = [d for n in active if n.id not in placed for d in n.devices]
        groups += [tuple(devices[i : i + unit]) for i in range(0, len(devices) - unit + 1, unit)]
        if not groups:
            return None
        return self._restart(component, active, sorted(groups), unit=unit)

    def _restart(
        self,
        component: ComponentId,
        drained: Sequence[Node],
        groups: Sequence[tuple[DeviceId, ...]],
        *,
        reassign: Sequence[tuple[ItemId, InstanceId]] = (),
        unit: int = 0,
    ) -> Migration:
        """A migration within ``component``: drain ``drained`` and start an instance
        on each of ``groups`` of their devices (the rest go to the free pool)."""
        serial = self._created[component]
        specs = tuple(
            InstanceSpec(id=self.graph.new_instance_id(component, serial + i), devices=g)
            for i, g in enumerate(groups)
        )
        migration = Migration(
            id=MigrationId(self.graph.next_migration_id + len(self.migrations)),
            kind=migration_kind(component, component, self.graph),
            src=component,
            dst=component,
            devices=tuple(sorted(d for n in drained for d in n.devices)),
            drain=tuple(n.id for n in drained),
            create=specs,
            reassign=tuple(reassign),
            unit=unit,
        )
        self.migrations.append(migration)
        self._drained.update(n.id for n in drained)
        self._num_drained[component] += len(drained)
        self._created[component] += len(specs)
        return migration

    def gather(
        self,
        dst: ComponentId,
        target: int,
        donors: Sequence[ComponentId],
        *,
        drain_rest: bool = False,
    ) -> bool:
        """Grow ``dst`` to exactly ``target`` instances from the free pool, then from
        ``donors`` in the given order. With ``drain_rest`` every donor instance is
        drained even once ``target`` is reached (the extra devices go to the free
        pool). Free devices too few for a whole instance join a donor's drained devices
        to complete one. Returns whether ``target`` was reached; devices that do not
        fill a whole ``dst`` instance go to the free pool, where the next decision
        picks them up."""
        unit = self.graph.components[dst].spec.devices_per_instance
        missing = target - self.instances(dst)
        free = self.free_devices()
        whole = min(max(missing, 0), len(free) // unit)
        if whole:
            m = self.move(None, dst, take_free=free[: whole * unit], create=whole)
            missing -= 0 if m is None else len(m.create)
        for cid in donors:
            available = len(self.drainable(cid))
            if not available or (missing <= 0 and not drain_rest):
                continue
            # Free devices too few for a whole instance complete a donor's devices.
            spare = len(self.free_devices())
            cunit = self.graph.components[cid].spec.devices_per_instance
            need = max(missing, 0) * unit - spare
            count = available if drain_rest else min(available, max(1, -(-need // cunit)))
            create = max(0, min(missing, (count * cunit + spare) // unit))
            extra = max(0, create * unit - count * cunit)
            m = self.move(cid, dst, drain=count, take_free=extra, create=create)
            missing -= 0 if m is None else len(m.create)
        return missing == 0

    def moved_devices(self) -> dict[ComponentId, int]:
        """Active devices per component after the migrations so far."""
        out = {c: n.num_active_devices for c, n in self.graph.components.items()}
        for m in self.migrations:
            if m.src is not None:
                out[m.src] -= sum(len(self.graph.instances[i].devices) for i in m.drain)
            if m.dst is not None:
                out[m.dst] += sum(len(spec.devices) for spec in m.create)
        return out

    def build(self, reason: str, *, score_before: float = 0.0, score_after: float = 0.0) -> Plan:
        """The plan of every migration added so far."""
        return Plan(
            migrations=tuple(self.migrations),
            reason=reason,
            score_before=score_before,
            score_after=score_after,
        )


def _first_device(node: Node) -> DeviceId:
    return min(node.devices)


def spread_peak(loads: Sequence[int], moved: int) -> int:
    """The most loaded engine after ``moved`` requests go one by one to the least
    loaded of engines with ``loads`` (as :meth:`PlanBuilder.spread` sends them): the
    least level ``h`` they fill up to, ``sum(max(0, h - load)) >= moved``, or the
    most loaded engine's own load if higher."""
    if not loads:
        return 0
    top = max(loads)
    if moved <= 0:
        return top
    ordered = sorted(loads)
    filled = 0  # requests that raise the first i engines to ordered[i]
    for i in range(1, len(ordered)):
        room = (ordered[i] - ordered[i - 1]) * i
        if filled + room >= moved:
            return max(top, ordered[i - 1] + -(-(moved - filled) // i))
        filled += room
    return max(top, ordered[-1] + -(-(moved - filled) // len(ordered)))
