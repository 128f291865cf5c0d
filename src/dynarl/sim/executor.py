"""The simulated executor: carries out the controller's migrations in a :class:`SimWorld`.

A workload migration aborts the drained engines' requests (keeping every generated
token), puts them back in the queue and routes them as the plan's ``reassign`` says;
a drained inference replica's samples go back to the front of its queue. A migration
that touches the trainer first waits for the optimizer-step boundary (the trainer is
resized only between steps). Each then takes the
:class:`~dynarl.sim.costs.MigrationCostModel` time on the virtual clock, after which
the world creates workers for the new instances.
"""

from typing import TYPE_CHECKING

from dynarl.control import events as ev
from dynarl.control.plan import Migration
from dynarl.control.topology import PROMPTS, TO_INFERENCE
from dynarl.core.ids import InstanceId, ItemId

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
        """Abort the drained instances' work, requeue it and route it as planned."""
        world = self.world
        requeued: dict[ItemId, None] = {}
        inf_requeued: list[ItemId] = []
        for iid in migration.drain:
            if iid in world.engines:
                requeued.update(dict.fromkeys(world.remove_engine(iid, now)))
            elif iid in world.inference.replicas:
                inf_requeued += world.inference.drain(iid, now)
        if requeued:
            generated = tuple(world.seqs[item].generated() for item in requeued)
            world.emit(ev.ItemsRequeued(edge=PROMPTS, items=tuple(requeued), generated=generated))
            for item in requeued:
                world.router.add(item, now_s=now, tool_calls=world.seqs[item].tool_calls)
        if inf_requeued:
            world.emit(ev.ItemsRequeued(edge=TO_INFERENCE, items=tuple(inf_requeued)))
            world.requeue_inference(inf_requeued)
        moved: dict[InstanceId, list[ItemId]] = {}
        for item, target in migration.reassign:
            node = world.graph.instances.get(target)
            if node is None or node.state != "active":
                continue
            if item in requeued and item in world.router and target in world.engines:
                world.router.remove(item)
                moved.setdefault(target, []).append(item)
            elif target in world.inference.replicas:
                world.assign_inference(target, item)
        for target, items in moved.items():
            world.assign_rollout(target, items, now)
        world.share_host(now)
