"""The simulated executor: carries out the controller's migrations in a :class:`SimWorld`.

A workload migration drains engines through the data plane's placement: nothing more
is routed to them from the migration's start, their queued requests are routed
elsewhere and their running ones, aborted (keeping every generated token), with them,
each to the engine the plan's ``reassign`` names (``Placement.plan``) if it can take
it; a drained inference replica's samples go back to the front of its queue and are
routed as ``reassign`` says. A migration
that touches the trainer first waits for the optimizer-step boundary (the trainer is
resized only between steps). Each then takes the
:class:`~dynarl.sim.costs.MigrationCostModel` time on the virtual clock, after which
the world creates workers for the new instances.
"""

from typing import TYPE_CHECKING

from dynarl.control import events as ev
from dynarl.control.plan import Migration
from dynarl.control.topology import TO_INFERENCE
from dynarl.core.ids import ItemId

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
        world.hold_engines(migration.drain, t0)
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
        """Drain the released instances: their requests are routed elsewhere, their
        samples requeued and routed as planned."""
        world = self.world
        inf_requeued: list[ItemId] = []
        for iid in migration.drain:
            if iid in world.engines:
                world.remove_engine(iid, now)
            elif iid in world.inference.replicas:
                inf_requeued += world.inference.drain(iid, now)
        if inf_requeued:
            world.emit(ev.ItemsRequeued(edge=TO_INFERENCE, items=tuple(inf_requeued)))
            world.requeue_inference(inf_requeued)
        for item, target in migration.reassign:
            node = world.graph.instances.get(target)
            if node is not None and node.state == "active" and target in world.inference.replicas:
                world.assign_inference(target, item)
        world.share_host(now)
