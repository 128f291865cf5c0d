"""Real worker processes over real ZeroMQ sockets (tcp and ipc): several workers share
the work, and a killed worker's in-flight items are served by the others."""

import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId
from dynarl.data import Router, RouterConfig
from dynarl.data.zmq_transport import ZmqTransport

from .helpers import CONSUMERS, CheckedGraph, item, wait_until

WORKER = Path(__file__).with_name("echo_worker.py")

pytestmark = pytest.mark.slow


@asynccontextmanager
async def processes(
    endpoint: str, names: list[str], *, capacity: int, delay_s: float
) -> AsyncIterator[dict[str, anyio.abc.Process]]:
    """Worker processes, killed at the end if they have not exited by then."""
    procs: dict[str, anyio.abc.Process] = {}
    try:
        for name in names:
            procs[name] = await anyio.open_process(
                [sys.executable, str(WORKER), endpoint, name, str(capacity), str(delay_s)],
                stdin=None,
                stdout=None,
                stderr=None,
            )
        yield procs
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs.values():
                with anyio.move_on_after(5):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await proc.aclose()


def _endpoint(kind: str, tmp: Path) -> str:
    return "tcp://127.0.0.1:*" if kind == "tcp" else f"ipc://{tmp}/router.sock"


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
async def test_several_worker_processes_share_the_work(kind: str, short_tmp: Path) -> None:
    names = ["w0", "w1", "w2"]
    graph = CheckedGraph(names)
    transport = ZmqTransport.bind(_endpoint(kind, short_tmp))
    try:
        async with (
            Router(transport, consumers=CONSUMERS, on_event=graph) as router,
            processes(transport.address, names, capacity=8, delay_s=0.001),
        ):
            with anyio.fail_after(30):
                await router.wait_for_instances(3)
            await router.submit([item(k) for k in range(600)])
            done = []
            with anyio.fail_after(30):
                while len(done) < 600:
                    done += await router.receive_batch()
            for name in names:
                await router.drain(InstanceId(name))
                await router.retire(InstanceId(name))
    finally:
        await transport.aclose()
    assert sorted(d.item.id for d in done) == sorted(f"i{k}" for k in range(600))
    assert all(d.result.payload == d.item.payload + b"@" + d.instance.encode() for d in done)
    assert set(Counter(d.instance for d in done)) == set(names)
    graph.check()


async def test_a_killed_worker_process_items_are_served_by_another(short_tmp: Path) -> None:
    names = ["w0", "w1", "w2"]
    graph = CheckedGraph(names)
    config = RouterConfig(heartbeat_interval_s=0.1, liveness_timeout_s=1.0)
    transport = ZmqTransport.bind(_endpoint("ipc", short_tmp))
    try:
        async with (
            Router(transport, consumers=CONSUMERS, on_event=graph, config=config) as router,
            processes(transport.address, names, capacity=4, delay_s=0.05) as procs,
        ):
            with anyio.fail_after(30):
                await router.wait_for_instances(3)
            await router.submit([item(k) for k in range(90)])
            await wait_until(lambda: router.statistics().num_completed >= 10, 30)
            w0 = InstanceId("w0")

            def w0_busy() -> bool:
                # Something in flight on w0, not only queued in front of it (between two
                # of its batches it may momentarily have nothing running).
                return len(graph.graph.instances[w0].items) > router.statistics().queues[w0].depth

            await wait_until(w0_busy, 30)
            # What w0 holds (queued in front of it or in flight on it), per the hypergraph.
            held = set(graph.graph.instances[w0].items)
            os.kill(procs["w0"].pid, signal.SIGKILL)
            done = []
            with anyio.fail_after(30):
                while len(done) < 90:
                    done += await router.receive_batch()
            for name in ("w1", "w2"):
                await router.drain(InstanceId(name))
                await router.retire(InstanceId(name))
    finally:
        await transport.aclose()
    ids = [d.item.id for d in done]
    assert sorted(ids) == sorted(f"i{k}" for k in range(90)), "an item was lost or duplicated"
    [failed] = [e for e in graph.events if isinstance(e, ev.WorkerFailed)]
    assert failed.instance == "w0"
    rescued = [d for d in done if d.item.id in held]
    assert len(rescued) == len(held) and {d.instance for d in rescued} <= {"w1", "w2"}
    graph.check()
