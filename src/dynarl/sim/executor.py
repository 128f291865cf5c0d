"""The simulated executor: carries out the controller's migrations in a :class:`SimWorld`.

A workload migration drains engines and inference replicas through the data plane's
placements: nothing more is routed to them from the migration's start, their queued
items are routed elsewhere and their running ones, aborted (an engine's keeping every
generated token, a replica's micro-batch lost), with them, each to the instance the
plan's ``reassign`` names (``Placement.plan``) if it can take it. A migration that
touches the trainer first waits for the optimizer-step boundary (the trainer is resized
only between steps). Each then takes the :class:`~dynarl.sim.costs.MigrationCostModel`
time on the virtual clock, after which the world creates workers for the new
instances.
"""

from collections.abc import Iterable
from typing import Protocol

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import Migration, MigrationKind
from dynarl.core.clock import Clock
from dynarl.core.ids import ComponentKind, InstanceId, ItemId


class MigratingWorld(Protocol):
    """What the executor drives of the world that owns it (the
    :class:`~dynarl.sim.world.SimWorld`)."""

    @property
    def graph(self) -> Hypergraph:
        """The controller's hypergraph (read only)."""

    @property
    def clock(self) -> Clock:
        """The controller's clock."""

    def now(self) -> float:
        """The world's time."""

    def plan_moves(self, reassign: Iterable[tuple[ItemId, InstanceId]]) -> None:
        """Where the drained instances' items go when next routed."""

    def hold_workers(self, iids: Iterable[InstanceId], now: float) -> None:
        """Route nothing more to ``iids``; their queued items go elsewhere."""

    async def step_boundary(self) -> None:
        """Return once no optimizer step runs."""

    def release(self, iids: Iterable[InstanceId], now: float) -> None:
        """Stop the workers of ``iids``; the items they held go elsewhere."""

    def charge_migration(
        self, kind: MigrationKind, src: ComponentKind | None, dst: ComponentKind | None
    ) -> float:
        """The move's time on the cost model, counted in the world's totals."""

    def placement_changed(self) -> None:
        """A migration ended: create workers for the new instances."""


class SimExecutor:
    """The controller's :class:`~dynarl.control.controller.Executor` for ``world``."""

    def __init__(self, world: MigratingWorld) -> None:
        self.world = world

    async def execute(self, migration: Migration) -> float:
        """Carry out ``migration``; return the seconds it waited for the
        optimizer-step boundary (not part of its cost)."""
        world = self.world
        comps = world.graph.components
        src = comps[migration.src].spec.kind if migration.src is not None else None
        dst = comps[migration.dst].spec.kind if migration.dst is not None else None
        t0 = world.now()
        # Nothing more is routed to the drained engines; they finish what runs until
        # they are released (after the step boundary, for the trainer's migrations).
        world.plan_moves(migration.reassign)
        world.hold_workers(migration.drain, t0)
        if "actor" in (src, dst):
            await world.step_boundary()
        waited = world.now() - t0
        try:
            self.release(migration, world.now())
            await world.clock.sleep(world.charge_migration(migration.kind, src, dst))
        finally:
            world.placement_changed()
        return waited

    def release(self, migration: Migration, now: float) -> None:
        """Drain the released instances: the items they held are routed elsewhere, as
        planned where the target can take them."""
        self.world.release(migration.drain, now)
