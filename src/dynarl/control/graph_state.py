"""The hypergraph's state, as the modules that change or check it see it.

:class:`~dynarl.control.hypergraph.Hypergraph` keeps this state and applies events to
it; :mod:`dynarl.control.device_placement` holds the code that changes its device
placement and :mod:`dynarl.control.invariants` verifies it. Those two take a
:class:`GraphState`, which the hypergraph is, so that they need not import the
hypergraph that calls them.
"""

from typing import Protocol

from dynarl.control.elements import HyperEdge, HyperNode, ItemState, Node
from dynarl.control.plan import Migration
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, InstanceId, MigrationId


class GraphState(Protocol):
    """The hypergraph's components, edges, instances and device placement, and the
    two pieces of its item bookkeeping that placing instances needs."""

    num_devices: int
    """Devices in the cluster, ids ``0 .. num_devices - 1``."""
    now_s: float
    """Time of the latest event applied."""
    components: dict[ComponentId, HyperNode]
    """A hypernode per component."""
    edges: dict[EdgeId, HyperEdge]
    """A hyperedge per dataflow, with its items."""
    instances: dict[InstanceId, Node]
    """Every instance, of every component."""
    device_owner: dict[DeviceId, InstanceId | MigrationId]
    """The instance or migration holding each device (absent: free)."""
    free_devices: set[DeviceId]
    """Devices no instance or migration holds."""
    crashed_devices: set[DeviceId]
    """Free devices whose worker crashed: using them again means a reboot."""
    crashed_in_migration: set[DeviceId]
    """Devices whose instance crashed while a migration drained it."""
    migrations: dict[MigrationId, Migration]
    """Migrations started and not yet done or failed."""
    next_migration_id: MigrationId
    """The id the next migration takes."""
    _instance_serial: dict[ComponentId, int]
    """The serial of each component's next instance."""

    def _instance(self, instance: InstanceId) -> Node:
        """The node of ``instance``; raises :class:`EventError` if there is none."""

    def _release(self, edge: HyperEdge, st: ItemState, time_s: float) -> None:
        """Move an item from its instance back to the edge's queue."""
