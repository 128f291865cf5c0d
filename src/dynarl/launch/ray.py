"""The Ray launcher: a run's workers as Ray actors across the nodes of a cluster.

Each device slot and each trainer worker is a :class:`~dynarl.launch.ray_actor.WorkerHost`
actor in its device's placement-group bundle (:mod:`dynarl.launch.ray_placement`:
one bundle per device, a model-parallel group of devices packed on one node). The
actor runs the same worker main a local process runs, which dials the controller's
data router over ZeroMQ TCP (the router's advertised address) and presents the run's
token at hello; from then on the worker is reached exactly like a local one.

A watcher thread follows every actor: when a worker's process ends or its actor dies
(killed, its node lost), the launcher tells the router at once, which reports a
``WorkerFailed`` and routes the worker's items elsewhere, as its liveness watch would
only after ``liveness_timeout_s``. The same thread copies each worker's output into
``log_dir/NAME.log`` on this machine (the run directory's ``workers/``).
"""

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from dynarl.data.errors import DataPlaneError
from dynarl.data.router import Router
from dynarl.launch.config import ClusterConfig
from dynarl.launch.launcher import WorkerLocation
from dynarl.launch.ray_actor import Whereabouts, WorkerHost
from dynarl.launch.ray_cluster import RayConnection
from dynarl.launch.ray_placement import DevicePlacement
from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.errors import LaunchError
from dynarl.workers.handles import SlotHandle
from dynarl.workers.main import slot_main
from dynarl.workers.slot import SlotConfig

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
"""How often the watcher thread looks at the actors and copies their logs."""

RESTART_WAIT_S = 5.0
"""Most time a restart waits for the watcher to see the old worker end."""


class RayWorker:
    """One worker the launcher started: its actor, the call that runs it, where it
    runs, and how it ended."""

    def __init__(
        self,
        name: str,
        device: int,
        actor: Any,
        router: Router,
        run: tuple[Callable[..., None], tuple[Any, ...]],
    ) -> None:
        self.name = name
        self.device = device
        self.actor = actor
        self.run = run
        """What the actor runs: the worker's entry and its arguments (a restart runs
        the same)."""
        self.handle = SlotHandle(router, name, alive=lambda: self.alive)
        self.run_ref: Any = None
        self.where: Whereabouts | None = None
        self.ended: str | None = None
        """Why it ended (``None`` while it runs)."""
        self.exited = anyio.Event()
        """Set once the launcher knows it ended."""
        self.log_offset = 0

    @property
    def alive(self) -> bool:
        """Whether its process still runs (as far as Ray told the launcher)."""
        return self.ended is None


class RayLauncher:
    """Device slots and trainer workers as Ray actors (see the module docstring).

    Args:
        router: the data router the workers connect to (bound on TCP, advertising an
            address the cluster's nodes can dial).
        cluster: the cluster section (``cluster.ray``: the cluster and the bundles).
        slot: how each slot runs.
        slot_devices: the device of each slot, in slot order.
        worker_devices: the device of each trainer worker, by name (a worker not named
            here takes the next device in order).
        group_size: consecutive devices kept on one node (a TP group).
        log_dir: where each worker's output is copied (``NAME.log``); ``None``: not kept.
        start_timeout_s: most time to place the devices and for each worker to say hello.
        stop_timeout_s: most time for each shutdown step.
    """

    def __init__(
        self,
        router: Router,
        cluster: ClusterConfig,
        *,
        slot: SlotConfig,
        slot_devices: Sequence[int],
        worker_devices: Mapping[str, int] | None = None,
        group_size: int = 1,
        log_dir: Path | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        if router.endpoint.startswith("ipc://"):
            raise LaunchError(
                f"Ray workers cannot reach a router on {router.address}: bind it on TCP "
                f"(cluster.bind_host)"
            )
        self.router = router
        self.cluster = cluster
        self.slot = slot
        self.slot_devices = list(slot_devices)
        self.worker_devices = dict(worker_devices or {})
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        devices = {*self.slot_devices, *self.worker_devices.values()} or {0}
        ray = cluster.ray
        self._placement = DevicePlacement(
            sorted(devices),
            group_size=group_size,
            bundle={"CPU": ray.cpus_per_device, "GPU": ray.gpus_per_device},
        )
        self._connection = RayConnection(
            ray, timeout_s=start_timeout_s, local_num_cpus=len(devices) * ray.cpus_per_device
        )
        self._slots: list[RayWorker] = []
        self._workers: list[RayWorker] = []
        self._watched: list[RayWorker] = []  # every worker started, for the watcher
        self._lock = threading.Lock()
        self._stop_watch = threading.Event()
        self._watch: threading.Thread | None = None
        self._token: Any = None
        self._closing = False
        self._opened = False
        self._open_lock = anyio.Lock()
        self._open_error: BaseException | None = None

    # ------------------------------------------------------------------ the protocol

    @property
    def handles(self) -> list[SlotHandle]:
        """The started slots' handles, in slot order."""
        return [w.handle for w in self._slots]

    @property
    def locations(self) -> dict[str, WorkerLocation]:
        """Where each started worker runs, by name."""
        return {
            w.name: WorkerLocation(
                name=w.name, host=w.where.ip, node=w.where.node_id, pid=w.handle.pid
            )
            for w in [*self._slots, *self._workers]
            if w.where is not None
        }

    async def start(self) -> None:
        """Connect to Ray, reserve the devices, start one actor per slot and wait
        until every slot has said hello. Raises :class:`LaunchError` otherwise."""
        if self._slots:
            raise LaunchError("the launcher is already started")
        await self._open()
        names = [f"slot-{i}" for i in range(len(self.slot_devices))]
        args = [(self.router.endpoint, name, self.slot) for name in names]
        self._slots = await self._start(slot_main, names, self.slot_devices, args)

    async def start_workers(
        self, entry: WorkerEntry, names: Sequence[str], *, num_threads: int
    ) -> list[SlotHandle]:
        """Start one actor per name running ``entry(endpoint, name, num_threads)`` on
        its device and wait until each has said hello."""
        await self._open()
        taken = len(self._workers)
        ordered = sorted({*self.slot_devices, *self.worker_devices.values()} or {0})
        devices = [
            self.worker_devices.get(name, ordered[(taken + k) % len(ordered)])
            for k, name in enumerate(names)
        ]
        args = [(self.router.endpoint, name, num_threads) for name in names]
        started = await self._start(entry, list(names), devices, args)
        self._workers += started
        return [w.handle for w in started]

    async def restart_slot(self, index: int) -> SlotHandle:
        """Start slot ``index`` again in a new actor on its device's bundle, after its
        worker ended (its process died, its actor was killed, or its node was lost:
        Ray places the bundle of a lost node on another node with room), and wait
        until it has said hello as a free slot; returns its new handle. Raises
        :class:`LaunchError` if the old worker still runs or the new one does not
        start in time."""
        self._slots[index] = await self._restart(self._slots[index])
        return self._slots[index].handle

    async def restart_worker(self, name: str) -> SlotHandle:
        """Start worker ``name`` again as :meth:`start_workers` started it, in a new
        actor on its device's bundle, after it ended; wait until it has said hello and
        return its new handle (raises as :meth:`restart_slot` does)."""
        index = next((i for i, w in enumerate(self._workers) if w.name == name), None)
        if index is None:
            raise LaunchError(f"no worker {name} was started")
        self._workers[index] = await self._restart(self._workers[index])
        return self._workers[index].handle

    async def _restart(self, old: RayWorker) -> RayWorker:
        if self._closing:
            raise LaunchError(f"the launcher is closing; {old.name} is not restarted")
        if old.alive and old.name not in self.router.instances:
            # The router heard of its death (a closed connection) before the watcher
            # saw the actor's run end.
            with anyio.move_on_after(RESTART_WAIT_S):
                await old.exited.wait()
        if old.alive:
            raise LaunchError(f"{old.name} still runs; it needs no restart")
        import ray

        # Its actor may outlive its process (the process exited, the actor did not).
        await anyio.to_thread.run_sync(lambda: ray.kill(old.actor, no_restart=True))
        entry, arg = old.run
        # Its node may be gone with it: until Ray's control store declares that node
        # dead (its health check, tens of seconds), the device's bundle still points
        # there and a new actor dies with it; then Ray re-places the bundle on a node
        # with room (a replacement joining, or spare capacity) and the actor starts.
        deadline = anyio.current_time() + self.start_timeout_s
        delay_s = 1.0
        while True:
            try:
                [worker] = await self._start(entry, [old.name], [old.device], [arg])
                break
            except LaunchError as error:
                if not _node_died(error) or anyio.current_time() + delay_s > deadline:
                    raise
                logger.warning(
                    "%s: its device's bundle was on a node that died; retrying in %.0f s "
                    "while Ray places it again",
                    old.name,
                    delay_s,
                )
                await anyio.sleep(delay_s)
                delay_s = min(2 * delay_s, 10.0)
        logger.info("restarted %s (device %d)", worker.name, worker.device)
        return worker

    async def aclose(self) -> None:
        """Retire every worker, end what is left (its process, then its actor), copy
        the last of the logs, release the devices and leave Ray. Idempotent; finishes
        even when cancelled."""
        with anyio.CancelScope(shield=True):
            self._closing = True
            with self._lock:  # every actor started, also by a start that failed
                workers, self._watched = self._watched, []
            self._slots, self._workers = [], []
            for w in workers:
                if w.alive:
                    with (
                        anyio.move_on_after(self.stop_timeout_s),
                        contextlib.suppress(DataPlaneError),
                    ):
                        await self.router.drain(w.handle.instance)
                        await self.router.retire(w.handle.instance, reason="shutdown")
            await anyio.to_thread.run_sync(self._stop_all, workers)
            self._stop_watch.set()
            if self._watch is not None:
                await anyio.to_thread.run_sync(self._watch.join, 30.0)
                self._watch = None
            if self._opened:
                await anyio.to_thread.run_sync(self._placement.remove)
                self._opened = False
            await self._connection.aclose()

    # ------------------------------------------------------------------ start

    async def _open(self) -> None:
        # start() and start_workers() may run side by side: one of them opens.
        async with self._open_lock:
            if self._open_error is not None:
                raise LaunchError(f"the Ray launcher did not start: {self._open_error}")
            if self._opened:
                return
            self._opened = True
            try:
                await self._connection.open()
                await self._placement.reserve(self.start_timeout_s)
            except BaseException as e:
                self._open_error = e
                raise
            self._token = anyio.lowlevel.current_token()
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            self._watch = threading.Thread(
                target=self._watch_loop, name="dynarl-ray-watch", daemon=True
            )
            self._watch.start()

    async def _start(
        self,
        entry: Callable[..., None],
        names: list[str],
        devices: Sequence[int],
        args: Sequence[tuple[Any, ...]],
    ) -> list[RayWorker]:
        import ray

        host_class: Any = ray.remote(WorkerHost)
        resources = self._placement.worker_resources()
        started: list[RayWorker] = []
        for name, device, arg in zip(names, devices, args, strict=True):
            actor = host_class.options(
                max_concurrency=4,  # run() blocks one thread; the other calls answer beside it
                max_restarts=0,  # a dead worker is reported, never silently restarted
                scheduling_strategy=self._placement.strategy(device),
                **resources,
            ).remote(name)
            worker = RayWorker(name, device, actor, self.router, (entry, arg))
            worker.run_ref = actor.run.remote(entry, arg)
            started.append(worker)
        with self._lock:
            self._watched.extend(started)
        wheres = await _get([w.actor.where.remote() for w in started], self.start_timeout_s)
        pids = await _get([w.actor.pid.remote() for w in started], self.start_timeout_s)
        for worker, where, pid in zip(started, wheres, pids, strict=True):
            worker.where = where
            worker.handle.pid = pid
            logger.info(
                "%s (device %d) runs on node %s (%s, node id %s), pid %s",
                worker.name,
                worker.device,
                where.ip,
                where.hostname,
                where.node_id[:12],
                pid,
            )
        with anyio.fail_after(self.start_timeout_s):
            for worker in started:
                await worker.handle.wait_connected(self.start_timeout_s)
        return started

    # ------------------------------------------------------------------ the watcher

    def _watch_loop(self) -> None:
        import ray

        while not self._stop_watch.is_set():
            with self._lock:
                running = [w for w in self._watched if w.alive]
                refs = [w.run_ref for w in running]
            if refs:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=WATCH_INTERVAL_S)
                for w in running:
                    if w.run_ref in done:
                        self._ended(w, _outcome(w.run_ref))
            else:
                self._stop_watch.wait(WATCH_INTERVAL_S)
            self._copy_logs([w for w in running if w.where is not None])

    def _ended(self, w: RayWorker, reason: str) -> None:
        w.ended = reason
        expected = self._closing
        logger.log(logging.INFO if expected else logging.WARNING, "%s ended: %s", w.name, reason)
        with contextlib.suppress(RuntimeError):  # the event loop is gone
            anyio.from_thread.run_sync(self._on_ended, w, expected, token=self._token)

    def _on_ended(self, w: RayWorker, expected: bool) -> None:
        if not expected:
            self.router.fail(w.handle.instance, f"{w.name} {w.ended}")
        w.exited.set()

    def _copy_logs(self, workers: Sequence[RayWorker]) -> None:
        import ray

        if self.log_dir is None or not workers:
            return
        refs = [w.actor.read_log.remote(w.log_offset) for w in workers]
        for w, ref in zip(workers, refs, strict=True):
            try:
                chunk: bytes = ray.get(ref, timeout=10.0)
            except Exception:
                continue
            if chunk:
                with (self.log_dir / f"{w.name}.log").open("ab") as f:
                    f.write(chunk)
                w.log_offset += len(chunk)

    # ------------------------------------------------------------------ stop

    def _stop_all(self, workers: Sequence[RayWorker]) -> None:
        """End every worker: wait for it to exit (it was retired), else stop its
        process; copy the rest of its log; kill its actor."""
        import ray

        refs = [w.run_ref for w in workers if w.run_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.stop_timeout_s)
        stops = {w.name: w.actor.stop.remote(self.stop_timeout_s) for w in workers}
        for w in workers:
            with contextlib.suppress(Exception):
                ray.get(stops[w.name], timeout=self.stop_timeout_s + 5.0)
        while True:  # the logs' tails (a read returns at most 1 MiB)
            before = [w.log_offset for w in workers]
            self._copy_logs(workers)
            if [w.log_offset for w in workers] == before:
                break
        for w in workers:
            with contextlib.suppress(Exception):
                ray.get(w.actor.close.remote(), timeout=5.0)
            ray.kill(w.actor, no_restart=True)
            if w.ended is None:
                w.ended = "stopped"
        for w in workers:
            with contextlib.suppress(RuntimeError):
                anyio.from_thread.run_sync(w.exited.set, token=self._token)


def _node_died(error: LaunchError) -> bool:
    """Whether ``error`` is an actor's start failing because its node died."""
    import ray

    cause = error.__cause__
    return isinstance(cause, ray.exceptions.ActorDiedError) and "node has died" in str(cause)


async def _get(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """The values of ``refs`` (raising :class:`LaunchError` if an actor died first)."""
    import ray

    try:
        with anyio.fail_after(timeout_s):
            return [await ref for ref in refs]
    except ray.exceptions.RayError as e:
        raise LaunchError(f"a worker's Ray actor failed to start: {e}") from e


def _outcome(run_ref: Any) -> str:
    """How a worker's run call ended, in words."""
    import ray

    try:
        code = ray.get(run_ref, timeout=1.0)
    except ray.exceptions.ActorDiedError as e:
        return f"lost its Ray actor (killed, or its node died): {_summary(e)}"
    except ray.exceptions.RayError as e:
        return f"failed under Ray: {_summary(e)}"
    return "exited" if code == 0 else f"exited with code {code}"


def _summary(error: BaseException) -> str:
    """The gist of a Ray error: the last line of the remote traceback it carries."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
