"""The local launcher: one worker process per device slot on this machine.

Slots are started once, before any work, with the ``spawn`` start method (no forked
copies of the controller's threads or sockets); each says hello to the data router as
a free slot and is then given roles through its
:class:`~dynarl.workers.handles.SlotHandle`. Moving a device between components
releases and resumes memory inside the slot; no process starts on the hot path.

Shutdown is graceful first, forceful after: the router takes back what each slot holds
and retires it (it exits on its own), then stragglers are terminated, then killed, each
step bounded by a timeout. If the launcher's process dies without shutting down (a
crash, ``SIGKILL``), each slot notices that its parent is gone and exits
(:func:`dynarl.workers.process.watch_parent`): no orphan survives either way.
"""

import contextlib
import logging
import multiprocessing
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Self

import anyio
import msgspec

from dynarl.data.errors import DataPlaneError
from dynarl.data.router import Router
from dynarl.launch.launcher import WorkerLocation
from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.errors import LaunchError
from dynarl.workers.handles import SlotHandle
from dynarl.workers.main import slot_main
from dynarl.workers.slot import SlotConfig

logger = logging.getLogger(__name__)


class LaunchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the local launcher starts and stops slots.

    Attributes:
        num_slots: device slots (processes) to start.
        slot: how each slot runs (torch threads, preloading, ...).
        name_prefix: slot ``i`` is named ``f"{name_prefix}-{i}"``.
        start_timeout_s: most time for every slot to say hello.
        retire_timeout_s: most time for the graceful shutdown step (every worker
            hands back what it holds and is retired; one busy in a collective or a
            role switch cannot answer), after which stragglers are terminated.
        stop_timeout_s: most time for each forceful shutdown step (terminate, kill).
    """

    num_slots: int = 1
    slot: SlotConfig = msgspec.field(default_factory=SlotConfig)
    name_prefix: str = "slot"
    start_timeout_s: float = 120.0
    retire_timeout_s: float = 3.0
    stop_timeout_s: float = 10.0


class Slot:
    """One started slot or worker: its process and its handle (and a worker's entry
    and threads, to start it again)."""

    def __init__(
        self,
        name: str,
        process: BaseProcess,
        handle: SlotHandle,
        entry: tuple[WorkerEntry, int] | None = None,
    ) -> None:
        self.name = name
        self.process = process
        self.handle = handle
        self.entry = entry

    @property
    def pid(self) -> int:
        """The slot's process id."""
        pid = self.process.pid
        assert pid is not None, "a started process has a pid"
        return pid


class LocalLauncher:
    """Worker processes for the device slots of this machine; ``async with`` it.

    Args:
        router: the data router the slots connect to (bound and running).
        config: how many slots, and how they run.
        endpoint: what the slots are started with (default: the router's
            :attr:`~dynarl.data.router.Router.endpoint`, its address and run token).
    """

    def __init__(
        self, router: Router, config: LaunchConfig | None = None, *, endpoint: str | None = None
    ) -> None:
        self.router = router
        self.config = config or LaunchConfig()
        self.endpoint = endpoint or router.endpoint
        self.slots: list[Slot] = []
        """The started slots, in order."""
        self.workers: list[Slot] = []
        """The started workers of other roles (trainer workers), in order."""

    @property
    def handles(self) -> list[SlotHandle]:
        """The started slots' handles, in order."""
        return [slot.handle for slot in self.slots]

    @property
    def locations(self) -> dict[str, WorkerLocation]:
        """Where each started slot and worker runs: this machine (loopback), by
        process id."""
        return {
            s.name: WorkerLocation(name=s.name, host="127.0.0.1", pid=s.process.pid)
            for s in [*self.slots, *self.workers]
        }

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def start(self) -> None:
        """Spawn every slot and wait until each has said hello.

        Raises :class:`LaunchError` if a slot exits or is not connected in time.
        """
        if self.slots:
            raise LaunchError("the launcher is already started")
        context = multiprocessing.get_context("spawn")
        cfg = self.config
        for i in range(cfg.num_slots):
            self.slots.append(self._spawn_slot(context, f"{cfg.name_prefix}-{i}"))
        logger.info("started %d slots; waiting for their hello", len(self.slots))
        with anyio.fail_after(cfg.start_timeout_s):
            for slot in self.slots:
                await slot.handle.wait_connected(cfg.start_timeout_s)

    def _spawn_slot(self, context: multiprocessing.context.BaseContext, name: str) -> Slot:
        process = context.Process(  # type: ignore[attr-defined]
            target=slot_main,
            args=(self.endpoint, name, self.config.slot),
            name=f"dynarl-{name}",
            daemon=True,
        )
        process.start()
        handle = SlotHandle(self.router, name, pid=process.pid, alive=process.is_alive)
        return Slot(name, process, handle)

    async def restart_slot(self, index: int) -> SlotHandle:
        """Start slot ``index`` again after its process died (the reboot of its
        device) and wait until it has said hello as a free slot; returns its new
        handle. Raises :class:`LaunchError` if the old process still runs."""
        old = self.slots[index]
        await self._reap(old)
        slot = self._spawn_slot(multiprocessing.get_context("spawn"), old.name)
        self.slots[index] = slot
        logger.info("restarted slot %s (pid %d)", slot.name, slot.pid)
        await slot.handle.wait_connected(self.config.start_timeout_s)
        return slot.handle

    async def restart_worker(self, name: str) -> SlotHandle:
        """Start worker ``name`` again as :meth:`start_workers` started it, after its
        process died, and wait until it has said hello; returns its new handle.
        Raises :class:`LaunchError` if the old process still runs."""
        index = next((i for i, w in enumerate(self.workers) if w.name == name), None)
        if index is None:
            raise LaunchError(f"no worker {name} was started")
        old = self.workers[index]
        assert old.entry is not None, "a started worker keeps its entry"
        await self._reap(old)
        entry, num_threads = old.entry
        worker = self._spawn_worker(multiprocessing.get_context("spawn"), entry, name, num_threads)
        self.workers[index] = worker
        logger.info("restarted worker %s (pid %d)", name, worker.pid)
        await worker.handle.wait_connected(self.config.start_timeout_s)
        return worker.handle

    async def _reap(self, old: Slot) -> None:
        """Collect ``old``'s dead process; :class:`LaunchError` if it still runs."""
        if old.process.is_alive():
            raise LaunchError(f"{old.name} still runs; it needs no restart")
        await anyio.to_thread.run_sync(old.process.join, self.config.stop_timeout_s)
        old.process.close()

    async def start_workers(
        self, entry: WorkerEntry, names: Sequence[str], *, num_threads: int
    ) -> list[SlotHandle]:
        """Spawn one process per name running ``entry(endpoint, name, num_threads)``
        and wait until each has said hello (as ``name``).

        Raises :class:`LaunchError` if one exits or is not connected in time.
        """
        context = multiprocessing.get_context("spawn")
        started = [self._spawn_worker(context, entry, name, num_threads) for name in names]
        self.workers += started
        timeout_s = self.config.start_timeout_s
        with anyio.fail_after(timeout_s):
            for worker in started:
                await worker.handle.wait_connected(timeout_s)
        return [worker.handle for worker in started]

    def _spawn_worker(
        self,
        context: multiprocessing.context.BaseContext,
        entry: WorkerEntry,
        name: str,
        num_threads: int,
    ) -> Slot:
        process = context.Process(  # type: ignore[attr-defined]
            target=entry,
            args=(self.endpoint, name, num_threads),
            name=f"dynarl-{name}",
            daemon=True,
        )
        process.start()
        handle = SlotHandle(self.router, name, pid=process.pid, alive=process.is_alive)
        return Slot(name, process, handle, entry=(entry, num_threads))

    async def aclose(self) -> None:
        """Stop every slot and worker: retire them all at once, then terminate, then
        kill what is left, each step bounded by ``stop_timeout_s`` and taken for every
        straggler together (a slot stuck in a collective costs one timeout, not one
        per slot). Idempotent; never raises for a process that is already gone."""
        slots, self.slots = [*self.slots, *self.workers], []
        self.workers = []
        timeout_s = self.config.stop_timeout_s
        grace_s = self.config.retire_timeout_s

        async def retire(slot: Slot) -> None:
            if slot.process.is_alive():
                with anyio.move_on_after(grace_s), contextlib.suppress(DataPlaneError):
                    await self.router.drain(slot.handle.instance)
                    await self.router.retire(slot.handle.instance, reason="shutdown")

        async with anyio.create_task_group() as tg:
            for slot in slots:
                tg.start_soon(retire, slot)
        for stop in (None, BaseProcess.terminate, BaseProcess.kill):
            alive = [slot for slot in slots if slot.process.is_alive()]
            if not alive:
                break
            if stop is not None:
                logger.info(
                    "%s did not exit; %s them",
                    ", ".join(slot.name for slot in alive),
                    stop.__name__,
                )
                for slot in alive:
                    stop(slot.process)
            wait_s = grace_s if stop is None else timeout_s
            async with anyio.create_task_group() as tg:
                for slot in alive:
                    tg.start_soon(anyio.to_thread.run_sync, slot.process.join, wait_s)
        for slot in slots:
            slot.process.close()
