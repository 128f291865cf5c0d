"""The launcher role: what starts, stops and watches the worker processes that stand
on a run's devices, and the table of launchers ``cluster.launcher`` names.

A launcher starts one device slot per device it is given, each connecting to the
controller's data router; a slot that dies is noticed by the router (its liveness
watch) and reported as a worker failure. :func:`build_launcher` makes the launcher the config
names, refusing one whose packages are missing or that is not built yet.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from dynarl.core.errors import ConfigError
from dynarl.data.router import Router
from dynarl.launch.config import ClusterConfig
from dynarl.workers.backends import Backend, WorkerEntry, check_name
from dynarl.workers.handles import SlotHandle
from dynarl.workers.slot import SlotConfig


class WorkerLocation(msgspec.Struct, frozen=True, kw_only=True):
    """Where one worker runs: its node's address (and Ray node id) and its process."""

    name: str
    host: str
    node: str | None = None
    pid: int | None = None


class Launcher(Protocol):
    """Starts and stops a run's device slots and other workers (trainer workers); a
    worker's death reaches the controller through the data router."""

    @property
    def handles(self) -> Sequence[SlotHandle]:
        """The started slots' handles, in slot order."""
        ...

    @property
    def locations(self) -> Mapping[str, WorkerLocation]:
        """Where each started slot and worker runs, by name."""
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


@runtime_checkable
class RestartsWorkers(Protocol):
    """A launcher that can start a dead worker's process again on its device (the
    reboot of a device whose slot or trainer worker died); a launcher without it
    leaves a device whose slot died to the actor, and one whose trainer worker died
    to the slots."""

    async def restart_slot(self, index: int) -> SlotHandle:
        """Start slot ``index`` again (its process died) and wait until it has said
        hello as a free slot; returns its new handle."""
        ...

    async def restart_worker(self, name: str) -> SlotHandle:
        """Start worker ``name`` (a trainer worker, see :meth:`Launcher.start_workers`)
        again as it was started (its process died) and wait until it has said hello;
        returns its new handle."""
        ...


LAUNCHERS: Mapping[str, Backend] = {
    "local": Backend(requires=(), extra="", built=True),
    "ray": Backend(requires=("ray",), extra="ray", built=True),
}
"""Every launcher, by name."""


def check(cluster: ClusterConfig) -> None:
    """Raise :class:`~dynarl.ConfigError` unless ``cluster.launcher`` can run here with
    ``cluster.accelerator``: the local launcher's workers run on this machine, so
    ``cuda`` needs CUDA here (Ray's workers run on other nodes: each checks its own as
    it builds, and fails naming the field)."""
    check_name("cluster.launcher", cluster.launcher, LAUNCHERS)
    if cluster.accelerator == "cuda" and cluster.launcher == "local":
        check_name("cluster.accelerator", "cuda", {"cuda": Backend(("torch",), "torch", True)})
        import torch  # only for cuda: checking the CPU needs no torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"cluster.accelerator=cuda, but this machine shows no CUDA device to "
                f"torch {torch.__version__} (CUDA build: {torch.version.cuda}), and the "
                f"local launcher runs every worker here: run on a machine with a GPU and "
                f"a CUDA torch, or set cluster.accelerator=cpu",
                field="cluster.accelerator",
            )


def build_launcher(
    cluster: ClusterConfig,
    router: Router,
    *,
    num_slots: int,
    slot: SlotConfig,
    slot_devices: Sequence[int] | None = None,
    worker_devices: Mapping[str, int] | None = None,
    group_size: int = 1,
    log_dir: Path | None = None,
) -> Launcher:
    """The launcher ``cluster.launcher`` names, for ``num_slots`` slots run as ``slot``
    says, connecting to ``router``.

    Where workers are placed (the Ray launcher): ``slot_devices`` (default
    ``0..num_slots-1``) and ``worker_devices`` (by name) are their devices, and each
    ``group_size`` consecutive devices stay on one node. ``log_dir`` receives the
    output of workers that run on other nodes."""
    check(cluster)
    if cluster.launcher == "ray":
        from dynarl.launch.ray import RayLauncher

        return RayLauncher(
            router,
            cluster,
            slot=slot,
            slot_devices=list(range(num_slots)) if slot_devices is None else slot_devices,
            worker_devices=worker_devices,
            group_size=group_size,
            log_dir=log_dir,
        )
    from dynarl.launch.local import LaunchConfig, LocalLauncher

    return LocalLauncher(router, LaunchConfig(num_slots=num_slots, slot=slot))
