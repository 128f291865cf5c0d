"""The real executor: carries out the controller's migrations on worker processes.

- **workload** (rollout, inference, the free pool): each released instance is drained
  by the router (its queued and in-flight requests come back with their partial
  output and go to the remaining engines; a running score call finishes first) and its
  slot frees the role's memory, keeping a host copy; each created instance is a slot
  assuming the role in place (build, or resume the host copy), brought to the weights
  the engines run before the router sees it. No process starts.
- **reshard** (into or out of the actor): at an optimizer-step boundary, the trainer's
  ranks move peer to peer onto the new devices, create-before-destroy
  (:meth:`~dynarl.workers.trainer.Trainer.resize`); a trainer left with
  no device is parked and resumes from its keeper. Slots on the devices involved
  release or assume their roles around it, so one process holds a device at a time.
- **reboot** (a crashed device, from the free pool): a slot whose process died is
  started again by the launcher (when it can: :class:`~dynarl.launch.launcher.RestartsWorkers`),
  then the device joins its component as in a move (a trainer worker that survived
  its slot takes the actor's share directly). A move of the actor onto a device whose
  trainer worker died (in any kind of migration) starts that worker again first: the
  new process joins the trainer's world, and the resize makes it a rank. Restarts are
  bounded (:mod:`~dynarl.api.restarts`). A reboot of a live instance raises: the
  controller records ``MigrationFailed`` and the old placement keeps running.

Failures are reported by raising, as the :class:`~dynarl.control.controller.Executor`
protocol asks.
"""

import logging
from collections.abc import Sequence

import anyio

from dynarl.api.world import RealWorld
from dynarl.control import events as ev
from dynarl.control.plan import Migration
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT
from dynarl.core.errors import DynaRLError
from dynarl.core.ids import DeviceId, InstanceId, MigrationId
from dynarl.workers.handles import SlotHandle

logger = logging.getLogger(__name__)

_SLOT_ROLES = (ROLLOUT, INFERENCE, None)


def trainer_rank_loss(error: BaseException) -> BaseException | None:
    """The trainer worker's death (or silence) inside ``error`` (an exception group's
    leaves and causes included), if that is what ``error`` is and the trainer could not
    rebuild itself from the survivors (the run cannot go on)."""
    from dynarl.workers.errors import TrainerError, TrainerRecoveredError

    if isinstance(error, TrainerRecoveredError):
        return None  # the trainer rebuilt itself from the survivors: it goes on
    if isinstance(error, TrainerError) and (
        error.worker >= 0 or "did not answer" in str(error) or "lost track" in str(error)
    ):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = trainer_rank_loss(inner)
            if found is not None:
                return found
    if error.__cause__ is not None:
        return trainer_rank_loss(error.__cause__)
    return None


class MigrationNotSupportedError(DynaRLError):
    """The real executor cannot carry out this kind of migration."""


class WorldExecutor:
    """Carries out migrations on a :class:`RealWorld`.

    Args:
        world: the started workers.
    """

    def __init__(self, world: RealWorld) -> None:
        self.world = world
        self._created: dict[MigrationId, list[InstanceId]] = {}

    def on_event(self, event: ev.Event) -> None:
        """Controller listener: once a migration is done (its instances placed in the
        hypergraph), the router may route to the rollout engines it created; a worker
        that failed is forgotten by the world."""
        if isinstance(event, ev.MigrationDone):
            for instance in self._created.pop(event.migration, ()):
                self.world.router.reactivate(instance)
        elif isinstance(event, ev.MigrationFailed):
            self._created.pop(event.migration, None)
        elif isinstance(event, ev.WorkerFailed):
            self.world.forget(event.instance)

    async def execute(self, migration: Migration) -> float | None:
        """Carry out ``migration``; raise if it cannot be (the old placement stays).
        Returns the seconds waited for an optimizer-step boundary."""
        src, dst = migration.src, migration.dst
        supported = (src in _SLOT_ROLES or src == ACTOR) and (dst in _SLOT_ROLES or dst == ACTOR)
        lost = self._lost_devices(migration)
        dead = self._dead_trainer_devices(migration)
        if (lost or dead) and not self.world.reboots.can_restart:
            raise MigrationNotSupportedError(
                f"migration {migration.id} needs devices {lost or dead}, whose "
                f"{'slot' if lost else 'trainer worker'} died, and the launcher cannot "
                "restart a worker"
            )
        for device in lost:  # the reboot: a new process on the crashed device
            await self.world.reboots.restart_slot(DeviceId(device))
        # A reboot from the free pool is a move once dead slots are restarted.
        rebootable = migration.kind != "reboot" or src is None
        if not (supported and rebootable):
            raise MigrationNotSupportedError(
                f"migration {migration.id} ({migration.kind}, {src} -> {dst}) is not "
                "supported on real workers; the old placement keeps running"
            )
        if ACTOR in (src, dst):
            try:
                if dead:  # the reboot: new trainer workers, in the trainer's world
                    await self.world.reboots.restart_trainer_workers(dead)
                waited = await self._reshard(migration)
            except Exception as error:
                rank_loss = trainer_rank_loss(error)
                if rank_loss is not None:
                    self.world.fail(rank_loss)  # the run cannot go on: stop it
                raise
        else:
            waited = None
            released = await self._release(migration)
            try:
                await self._create(migration)
            except BaseException:
                # The slots that did not take the new role go back to the old one.
                await self._restore(migration, released)
                raise
        logger.info("migration %d done: %s -> %s", migration.id, src, dst)
        return waited

    async def _release(self, migration: Migration) -> list[tuple[InstanceId, SlotHandle]]:
        """Release ``migration``'s drained instances (:meth:`RealWorld.release`); if one cannot be
        (its slot died as the move started), those released before it run again and
        the error propagates: a move that fails leaves every survivor serving, as the
        controller's restored placement says."""
        released: list[tuple[InstanceId, SlotHandle]] = []
        try:
            for instance in migration.drain:
                slot = await self.world.release(instance)
                if slot is not None:
                    released.append((instance, slot))
        except BaseException:
            await self._restore(migration, released)
            raise
        return released

    async def _restore(
        self, migration: Migration, released: Sequence[tuple[InstanceId, SlotHandle]]
    ) -> None:
        """Undo :meth:`_release` for the slots still alive and still holding the
        released role (one that took the new role, or died, is not put back: the
        router reports a dead one and the controller forgets its instance)."""
        with anyio.CancelScope(shield=True):
            for instance, slot in released:
                if not (slot.alive and slot.instance == instance and slot.role == migration.src):
                    continue
                try:
                    await self.world.restore(instance, slot)
                except Exception as error:  # it died meanwhile: the router reports it
                    logger.warning("could not restore %s on %s: %s", instance, slot.name, error)

    def _lost_devices(self, migration: Migration) -> list[int]:
        """Devices of ``migration``'s new instances whose slot process died."""
        world = self.world
        if migration.dst not in (ROLLOUT, INFERENCE):
            return []  # the actor's ranks are trainer workers, not slots
        devices = [d for spec in migration.create for d in spec.devices]
        return [
            int(d) for d in devices if d in world.slot_devices and world.slot(d).name in world.lost
        ]

    def _dead_trainer_devices(self, migration: Migration) -> list[DeviceId]:
        """Devices the actor grows onto whose trainer worker died."""
        if migration.dst != ACTOR:
            return []
        devices = [d for spec in migration.create for d in spec.devices]
        return self.world.reboots.dead_trainer_devices(devices)

    async def _reshard(self, migration: Migration) -> float:
        world = self.world
        graph = world.graph
        leaving: list[DeviceId] = []
        async with world.actor_boundary() as waited:
            if migration.src == ACTOR:
                leaving = [
                    d
                    for i in migration.drain
                    if (node := graph.instances.get(i)) is not None
                    for d in node.devices
                ]
                await world.resize_actor(leaving=leaving)
            else:
                released = await self._release(migration)
                joining = [DeviceId(d) for spec in migration.create for d in spec.devices]
                try:
                    await world.resize_actor(joining=joining)
                except BaseException:
                    await self._restore(migration, released)  # create-before-destroy
                    raise
        if migration.dst != ACTOR:
            try:
                await self._create(migration)
            except BaseException:
                if leaving:
                    # The move fails as a whole (a slot died taking its role): the actor
                    # takes its devices back, so the placement the controller restores
                    # is the one that runs.
                    with anyio.CancelScope(shield=True):
                        async with world.actor_boundary():
                            await world.resize_actor(joining=leaving)
                raise
        return waited

    async def _create(self, migration: Migration) -> None:
        dst = migration.dst
        if dst is None or not migration.create:
            return
        self._created[migration.id] = [spec.id for spec in migration.create]
        await self.world.assume(dst, [(spec.devices, spec.id) for spec in migration.create])
