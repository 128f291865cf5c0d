"""The launcher role: what starts, stops and watches the worker processes that stand
on a run's devices.

A launcher starts one device slot per device it is given, each connecting to the
controller's data router; a slot that dies is noticed by the router (its liveness
watch) and reported as a worker failure. The launchers ``cluster.launcher`` names are
in :mod:`~dynarl.launch.launchers`.
"""

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.handles import SlotHandle


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
