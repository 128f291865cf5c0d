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

from typing import TYPE_CHECKING

from dynarl.control.plan import Migration

if TYPE_CHECKING:
    from dynarl.sim.world import SimWorld


class SimExecutor:
    """The controller's :class:`~dynarl.control.controller.Executor` for ``world``."""

    def __init__(self, world: "SimWorld") -> None:
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
        world.fleet.placement.plan(
            (item, target) for item, target in migration.reassign if target in world.engines
        )
        world.inference.plan(migration.reassign)
        world.hold_workers(migration.drain, t0)
        if "actor" in (src, dst):
            await world.step_boundary()
        waited = world.now() - t0
        try:
            self.release(migration, world.now())
            cost = world.cluster.migration.move_time_s(
                migration.kind, src, dst, world.cluster.model
            )
            world.totals.migration_s += cost
            await world.clock.sleep(cost)
        finally:
            world.placement_changed()
        return waited

    def release(self, migration: Migration, now: float) -> None:
        """Drain the released instances: the items they held are routed elsewhere, as
        planned where the target can take them."""
        world = self.world
        for iid in migration.drain:
            if iid in world.engines:
                world.remove_engine(iid, now)
            elif iid in world.inference.workers:
                world.remove_replica(iid, now)
        world.share_host(now)
