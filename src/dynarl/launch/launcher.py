"""The launcher role: what starts, stops and watches the worker processes that stand
on a run's devices, and the table of launchers ``cluster.launcher`` names.

A launcher starts one device slot per device it is given, each connecting to the
controller's data router; a slot that dies is noticed by the router (its liveness
watch) and reported as a worker failure. :func:`build_launcher` makes the launcher the config
names, refusing one whose packages are missing or that is not built yet.
"""

from collections.abc import Mapping, Sequence
from typing import Protocol

from dynarl.data.router import Router
from dynarl.launch.config import ClusterConfig
from dynarl.workers.backends import Backend, WorkerEntry, check_name
from dynarl.workers.handles import SlotHandle
from dynarl.workers.slot import SlotConfig


class Launcher(Protocol):
    """Starts and stops a run's device slots and other workers (trainer workers); a
    worker's death reaches the controller through the data router."""

    @property
    def handles(self) -> Sequence[SlotHandle]:
        """The started slots' handles, in slot order."""
        ...

    async def start(self) -> None:
        """Start every slot and wait until each has said hello to the router."""
        ...

    async def start_workers(
        self, entry: WorkerEntry, names: Sequence[str], *, num_threads: int
    ) -> list[SlotHandle]:
        """Start one worker process of another role (a trainer worker) per name, each
        running ``entry``, and wait until each has said hello; returns their handles
        (process id, liveness)."""
        ...

    async def aclose(self) -> None:
        """Stop every slot and worker (gracefully, then by force); idempotent, and
        finishes even when cancelled."""
        ...


LAUNCHERS: Mapping[str, Backend] = {
    "local": Backend(requires=(), extra="", built=True),
    "ray": Backend(
        requires=("ray",),
        extra="ray",
        built=False,
        note="the Ray launcher is not built yet in this version; use cluster.launcher=local",
    ),
}
"""Every launcher, by name."""


def check(cluster: ClusterConfig) -> None:
    """Raise :class:`~dynarl.ConfigError` unless ``cluster.launcher`` can run here."""
    check_name("cluster.launcher", cluster.launcher, LAUNCHERS)


def build_launcher(
    cluster: ClusterConfig, router: Router, *, num_slots: int, slot: SlotConfig
) -> Launcher:
    """The launcher ``cluster.launcher`` names, for ``num_slots`` slots run as ``slot``
    says, connecting to ``router``."""
    check(cluster)
    from dynarl.launch.local import LaunchConfig, LocalLauncher

    return LocalLauncher(router, LaunchConfig(num_slots=num_slots, slot=slot))
