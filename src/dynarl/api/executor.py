"""The real executor: carries out the controller's migrations on worker processes.

- **workload** between rollout, inference and the free pool: the router drains each
  released instance (its queued and in-flight requests come back with their partial
  output and go to the remaining engines), and its slot assumes the destination role
  in place (release memory, build or resume the new role, reconnect); no process
  starts.
- **reshard** and moves into or out of the actor, and **reboot**, are not carried
  out yet: they raise, so the controller records ``MigrationFailed`` and the old
  placement keeps running.

Failures are reported by raising, as the :class:`~dynarl.control.controller.Executor`
protocol asks.
"""

import logging

from dynarl.api.world import RealWorld
from dynarl.control.plan import Migration
from dynarl.control.topology import INFERENCE, ROLLOUT
from dynarl.core.errors import DynaRLError

logger = logging.getLogger(__name__)


class MigrationNotSupportedError(DynaRLError):
    """The real executor cannot carry out this kind of migration yet."""


class WorldExecutor:
    """Carries out migrations on a :class:`RealWorld`.

    Args:
        world: the started workers.
    """

    def __init__(self, world: RealWorld) -> None:
        self.world = world

    async def execute(self, migration: Migration) -> None:
        """Carry out ``migration``; raise if it cannot be (the old placement stays)."""
        slot_roles = (ROLLOUT, INFERENCE, None)
        if (
            migration.kind != "workload"
            or migration.src not in slot_roles
            or (migration.dst not in slot_roles)
        ):
            raise MigrationNotSupportedError(
                f"migration {migration.id} ({migration.kind}, {migration.src} -> "
                f"{migration.dst}) is not supported by the real executor yet; use "
                "scheduler.mode=static-disaggregated for real runs"
            )
        world = self.world
        for instance in migration.drain:
            await world.router.drain(instance)
            world.rollout.pop(instance, None)
            world.inference.pop(instance, None)
        for spec in migration.create:
            slot = world.slot(spec.devices[0])
            if migration.dst == ROLLOUT:
                world.rollout[spec.id] = await slot.assume_role(
                    world.rollout_role, instance=spec.id
                )
            else:
                world.inference[spec.id] = await slot.assume_role(
                    world.inference_role, instance=spec.id
                )
        # The new role holds the weights the slot had when it last held it (or the
        # seed's); the next weight sync brings it up to date.
        logger.info("migration %d done: %s -> %s", migration.id, migration.src, migration.dst)
