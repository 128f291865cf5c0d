"""The reboot of a crashed device in a real run: its dead slot or trainer worker
started again by the launcher (when it can, :class:`~dynarl.launch.launcher.RestartsWorkers`),
within the restart budget (:mod:`dynarl.api.restarts`); a restarted trainer worker
rejoins the trainer's world, holding no state, until a resize makes it a rank."""

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from dynarl.api.engine_weights import EngineWeights
from dynarl.api.restarts import RestartBudget
from dynarl.core.ids import DeviceId, InstanceId
from dynarl.data.router import Router
from dynarl.launch.launcher import Launcher, RestartsWorkers
from dynarl.workers.errors import LaunchError
from dynarl.workers.handles import SlotHandle
from dynarl.workers.trainer import Trainer

logger = logging.getLogger(__name__)


class RebootableWorld(Protocol):
    """What a reboot reads of the world that owns it (the real run's
    :class:`~dynarl.api.world.RealWorld`): its processes and their devices, the
    trainer, the router and the engines' weights. It changes the collections in place
    (a restarted process replaces the dead one's handle; a restarted slot is no
    longer lost)."""

    @property
    def launcher(self) -> Launcher:
        """Starts the processes (and, if it :class:`RestartsWorkers`, starts them again)."""

    @property
    def slot_devices(self) -> list[DeviceId]:
        """Devices with a slot process, in slot order."""

    @property
    def lost(self) -> set[str]:
        """Names of slots whose worker died."""

    @property
    def weights(self) -> EngineWeights:
        """The weight-sync group and the version the engines run."""

    @property
    def trainer(self) -> Trainer | None:
        """The actor, once started."""

    @property
    def trainer_devices(self) -> list[DeviceId]:
        """Devices with a trainer worker, in worker order."""

    @property
    def trainer_names(self) -> list[str]:
        """The trainer workers' names, in worker order."""

    @property
    def trainer_workers(self) -> list[SlotHandle]:
        """The trainer's worker processes, in worker order."""

    @property
    def router(self) -> Router:
        """The data router (it knows which workers are connected)."""

    def trainer_members(self, devices: Sequence[DeviceId]) -> list[int]:
        """The trainer workers of ``devices``."""


class Reboots:
    """Restarts ``world``'s dead workers (the world owns one)."""

    def __init__(self, world: RebootableWorld) -> None:
        self.world = world
        self.budget = RestartBudget()
        """How often dead slots and trainer workers may still be started again."""
        self._respawned: set[int] = set()  # trainer workers restarted, not admitted yet

    @property
    def can_restart(self) -> bool:
        """Whether the launcher can start a dead slot's or trainer worker's process
        again."""
        return isinstance(self.world.launcher, RestartsWorkers)

    def _restarter(self, device: DeviceId, what: str) -> RestartsWorkers:
        launcher = self.world.launcher
        if not isinstance(launcher, RestartsWorkers):
            raise LaunchError(
                f"the {type(launcher).__name__} cannot restart a dead worker; device "
                f"{device} serves {what} only"
            )
        return launcher

    async def restart_slot(self, device: DeviceId) -> SlotHandle:
        """Start ``device``'s dead slot again (the reboot of a crashed device): a new
        process, free, holding the seed's weights until it assumes a role (then it is
        brought to the engines' version like any slot taking a role). Raises
        :class:`LaunchError` if the restart budget refuses it."""
        launcher = self._restarter(device, "the actor")
        index = self.world.slot_devices.index(device)
        self.budget.take(self.world.launcher.handles[index].name, kind="slot")
        handle = await launcher.restart_slot(index)
        self.world.lost.discard(handle.name)
        self.world.weights.forget_slot(handle.name)
        return handle

    def dead_trainer_devices(self, devices: Sequence[DeviceId]) -> list[DeviceId]:
        """Those of ``devices`` whose trainer worker died (the trainer went on without
        it, or its process is gone and the trainer has yet to notice): the actor can
        use them again only once it is restarted."""
        assert self.world.trainer is not None, "start the world first"
        dead = self.world.trainer.dead
        return [
            d
            for d in devices
            if d in self.world.trainer_devices
            and ((w := self.world.trainer_devices.index(d)) in dead or self._trainer_worker_gone(w))
        ]

    def _trainer_worker_gone(self, w: int) -> bool:
        """Whether trainer worker ``w``'s process is gone: its launcher says so, or the
        router lost its connection (a Ray launcher hears of an actor's end a moment
        after the router does)."""
        name = InstanceId(self.world.trainer_names[w])
        return not self.world.trainer_workers[w].alive or name not in self.world.router.instances

    async def restart_trainer_workers(self, devices: Sequence[DeviceId]) -> None:
        """Start the dead trainer workers of ``devices`` again (the reboot of a device
        whose trainer worker died; one restarted before and not admitted yet is not
        started twice): new processes, which join the trainer's world at its next step
        boundary, holding no state (a resize makes them ranks, their state coming peer
        to peer). Raises :class:`LaunchError` if the launcher cannot or the restart
        budget refuses."""
        trainer = self.world.trainer
        assert trainer is not None, "start the world first"
        launcher = self._restarter(devices[0], "the slots")
        workers = self.world.trainer_members(devices)
        started = time.perf_counter()
        for w in workers:
            name = self.world.trainer_names[w]
            # Dead: its process is gone, or the trainer met its death (and it was not
            # restarted since).
            died = w in trainer.dead and w not in self._respawned
            if died or self._trainer_worker_gone(w):
                self.budget.take(name, kind="trainer")
                self.world.router.hold(InstanceId(name))  # no samples until it is a rank
                self.world.trainer_workers[w] = await launcher.restart_worker(name)
                self._respawned.add(w)
        spawned = time.perf_counter()
        await trainer.admit(tuple(workers))
        self._respawned.difference_update(workers)
        logger.warning(
            "trainer workers %s restarted (%.2f s) and back in the trainer's world (%.2f s more)",
            workers,
            spawned - started,
            time.perf_counter() - spawned,
        )
