"""The launcher role's contract (:class:`~dynarl.launch.launcher.Launcher`), for every
launcher: the device slots and the workers it starts say hello to the data router and
answer calls; a worker that dies reaches the router as a worker failure; closing leaves
no process, and closing twice is harmless."""

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from dynarl.control import events as ev
from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import PeerLostError, Router, RouterConfig, open_worker_link
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.binding import bind_controller
from dynarl.launch.config import ClusterConfig
from dynarl.launch.launcher import Launcher
from dynarl.launch.launchers import build_launcher
from dynarl.workers.slot import SlotConfig

pytestmark = pytest.mark.slow

LAUNCHERS = ["local", "ray"]


def call_worker(endpoint: str, name: str, num_threads: int) -> None:
    """A worker process that answers every call with ``b"pong:" + body``."""

    async def serve() -> None:
        transport = ZmqTransport.connect(endpoint)
        try:
            async with open_worker_link(
                transport, instance=InstanceId(name), component=ComponentId("test"), capacity=1
            ) as link:
                while True:
                    call = await link.receive_call()
                    await link.reply(call.corr, b"pong:" + call.body)
        except PeerLostError:
            pass
        finally:
            await transport.aclose()

    anyio.run(serve)


class Cluster:
    def __init__(self) -> None:
        self.failed: dict[str, anyio.Event] = {}

    def start(self, router: Router, launcher: Launcher) -> None:
        self.router = router
        self.launcher = launcher

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorkerFailed):
            self.failed.setdefault(event.instance, anyio.Event()).set()

    async def wait_failed(self, instance: str) -> None:
        await self.failed.setdefault(instance, anyio.Event()).wait()


@contextlib.asynccontextmanager
async def open_cluster(name: str, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """A router and the launcher ``name`` (two slots), in this task."""
    if name == "ray":
        request.getfixturevalue("ray_cluster")  # the session's Ray cluster
    folder = Path(tempfile.mkdtemp(prefix="dyn-"))
    # Where the launcher's workers can reach it: ipc for local ones, TCP for Ray's.
    transport, _ = bind_controller(ClusterConfig(launcher=name), folder)
    config = RouterConfig(heartbeat_interval_s=0.2, liveness_timeout_s=2.0)
    cluster = Cluster()
    try:
        async with Router(
            transport, consumers={}, config=config, on_event=cluster.on_event
        ) as router:
            launcher = build_launcher(
                ClusterConfig(launcher=name), router, num_slots=2, slot=SlotConfig()
            )
            cluster.start(router, launcher)
            try:
                yield cluster
            finally:
                await launcher.aclose()
    finally:
        await transport.aclose()
        shutil.rmtree(folder, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def still_alive(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", LAUNCHERS)
async def test_what_it_starts_says_hello_answers_and_is_gone_after_close(
    name: str, request: pytest.FixtureRequest
) -> None:
    async with open_cluster(name, request) as cluster:
        await check_start_and_close(cluster)


async def check_start_and_close(cluster: Cluster) -> None:
    launcher = cluster.launcher
    await launcher.start()
    workers = await launcher.start_workers(call_worker, ["w-0", "w-1"], num_threads=1)
    assert {h.name for h in launcher.handles} <= set(cluster.router.instances)
    assert {"w-0", "w-1"} <= set(cluster.router.instances)
    assert await cluster.router.call(InstanceId("w-1"), b"ping") == b"pong:ping"
    pids = [h.pid for h in [*launcher.handles, *workers] if h.pid is not None]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    await launcher.aclose()
    assert await anyio.to_thread.run_sync(still_alive, pids, 10.0) == []
    await launcher.aclose()  # closing twice is harmless


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", LAUNCHERS)
async def test_a_worker_that_dies_reaches_the_router_as_a_failure(
    name: str, request: pytest.FixtureRequest
) -> None:
    async with open_cluster(name, request) as cluster:
        await cluster.launcher.start()
        (worker,) = await cluster.launcher.start_workers(call_worker, ["w-0"], num_threads=1)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        with anyio.fail_after(30):
            await cluster.wait_failed("w-0")
        assert "w-0" not in cluster.router.instances
