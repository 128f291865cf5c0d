"""The router over TCP with a run token: a worker presenting the token joins; a peer
with a wrong or missing token, or one that skips the hello, is refused in words,
counted, and neither joins nor reaches the controller's events. Real ZeroMQ sockets
over TCP on loopback. Also: a worker its launcher saw die is failed at once."""

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId
from dynarl.data import (
    CONTROLLER,
    PeerLostError,
    Router,
    RouterConfig,
    WorkerLink,
    open_worker_link,
    wire,
)
from dynarl.data.codec import Rejections, worker_codec
from dynarl.data.endpoint import (
    advertised_address,
    new_token,
    split_endpoint,
    worker_endpoint,
)
from dynarl.data.errors import DataPlaneError, UnauthorizedError
from dynarl.data.zmq_transport import ZmqTransport

from .helpers import CONSUMERS, ROLLOUT, Net, cluster, echo, item, wait_until

FAST = RouterConfig(heartbeat_interval_s=0.05, liveness_timeout_s=2.0)
SLOW_LIVENESS = RouterConfig(heartbeat_interval_s=0.05, liveness_timeout_s=60.0)


class Controller:
    """A router bound on TCP loopback with a token, recording its events."""

    def __init__(self, router: Router, token: str) -> None:
        self.router = router
        self.token = token
        self.events: list[ev.Event] = []


@asynccontextmanager
async def tcp_controller() -> AsyncIterator[Controller]:
    transport = ZmqTransport.bind("tcp://127.0.0.1:*")
    token = new_token()
    events: list[ev.Event] = []
    try:
        async with Router(
            transport,
            consumers=CONSUMERS,
            config=FAST,
            token=token,
            advertised_address=advertised_address(transport.address),
            on_event=events.append,
        ) as router:
            c = Controller(router, token)
            c.events = events
            yield c
    finally:
        await transport.aclose()


async def _hello_as(address: str, token: str) -> None:
    worker = ZmqTransport.connect(address)
    try:
        async with open_worker_link(
            worker, instance=InstanceId("intruder"), component=ROLLOUT, capacity=4, token=token
        ):
            pytest.fail("a worker with a wrong token was welcomed")
    finally:
        await worker.aclose()


async def test_the_endpoint_carries_the_advertised_address_and_the_token() -> None:
    async with tcp_controller() as controller:
        address, token = split_endpoint(controller.router.endpoint)
        assert address == controller.router.address  # bound on 127.0.0.1: advertised as is
        assert address.startswith("tcp://127.0.0.1:") and token == controller.token
        assert split_endpoint(worker_endpoint("ipc:///x", "")) == ("ipc:///x", "")
        assert advertised_address("tcp://0.0.0.0:5000", "10.1.2.3") == "tcp://10.1.2.3:5000"
        with pytest.raises(DataPlaneError, match="run token"):
            ZmqTransport.connect(controller.router.endpoint)


async def test_a_worker_with_a_wrong_or_missing_token_is_refused_and_counted() -> None:
    async with tcp_controller() as controller:
        address, _ = split_endpoint(controller.router.endpoint)
        with anyio.fail_after(10):
            with pytest.raises(UnauthorizedError, match="wrong run token"):
                await _hello_as(address, "not-" + controller.token)
            with pytest.raises(UnauthorizedError, match="no run token"):
                await _hello_as(address, "")
        stats = controller.router.statistics()
        assert stats.rejected == {"unauthorized": 2}
        assert stats.num_workers == 0 and controller.router.instances == []
        assert controller.events == []


async def test_a_peer_that_skips_the_hello_injects_nothing() -> None:
    async with tcp_controller() as controller:
        address, _ = split_endpoint(controller.router.endpoint)
        raw = ZmqTransport.connect(address)
        codec = worker_codec(Rejections("test"))
        forged = ev.EngineStats(
            time_s=0.0, instance=InstanceId("w0"), kv_usage=0.9, num_running=0, num_queued=0
        )
        try:
            await raw.send(CONTROLLER, msgspec.msgpack.encode(wire.Report(forged)))
            with anyio.fail_after(10):
                [(_, frame)] = await raw.receive_batch(1)
        finally:
            await raw.aclose()
        refused = codec.decode(frame)
        assert isinstance(refused, wire.Refused) and refused.code == "unknown"
        assert controller.events == []
        assert controller.router.statistics().rejected == {"unexpected": 1}


async def test_a_worker_with_the_token_joins_and_serves() -> None:
    async with tcp_controller() as controller:
        address, token = split_endpoint(controller.router.endpoint)
        worker = ZmqTransport.connect(address)
        try:
            async with (
                open_worker_link(
                    worker, instance=InstanceId("w0"), component=ROLLOUT, capacity=4, token=token
                ) as link,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(echo, link)
                with anyio.fail_after(10):
                    await controller.router.submit([item(1)])
                    [done] = await controller.router.receive_batch()
                tg.cancel_scope.cancel()
        finally:
            await worker.aclose()
        assert done.instance == "w0" and done.result.payload == b"p1@w0"
        assert controller.router.statistics().rejected == {}


async def test_a_worker_its_launcher_saw_die_is_failed_at_once_and_its_items_move(
    inproc: Net,
) -> None:
    # The worker holds its items and stays silent (a node that vanished without closing
    # its connection): only the launcher's word makes the router act before the
    # liveness timeout.
    async with cluster(inproc, ["w0"], all_instances=["w0", "w1"], config=SLOW_LIVENESS) as c:
        c.add_worker("w1", serve=hold_forever)
        with anyio.fail_after(10):
            await c.router.wait_for_instances(2)
        c.router.hold(InstanceId("w0"))
        await c.router.submit([item(k) for k in range(4)])
        await wait_until(lambda: c.router.statistics().num_in_flight == 4)
        c.router.reactivate(InstanceId("w0"))
        c.router.fail(InstanceId("w1"), "its Ray actor died")
        c.router.fail(InstanceId("nobody"), "unknown instances are ignored")
        done = await c.collect(4)
        failed = c.graph.of(ev.WorkerFailed)
    assert sorted(d.item.id for d in done) == [f"i{k}" for k in range(4)]
    assert {d.instance for d in done} == {"w0"}
    assert [(e.instance, e.reason) for e in failed] == [("w1", "its Ray actor died")]


async def hold_forever(link: WorkerLink) -> None:
    """Take items and never hand them back."""
    with contextlib.suppress(PeerLostError):
        while True:
            await link.receive()
