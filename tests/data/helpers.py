"""Helpers for the data-plane tests: transport ends of each kind, a hypergraph that
checks the router's events, and an echo worker."""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec
from dynarl.control.topology import ComponentSpec, EdgeSpec, PipelineSpec
from dynarl.core.clock import ManualClock
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, ItemId
from dynarl.data import (
    InProcNetwork,
    Item,
    ItemResult,
    PeerLostError,
    RoutedResult,
    Router,
    Transport,
    WorkerLink,
    open_worker_link,
)
from dynarl.data._tasks import task_group
from dynarl.data.peers import WorkerState
from dynarl.data.request_order import FifoOrder
from dynarl.data.request_queue import RequestQueue
from dynarl.data.transport import PeerId
from dynarl.data.zmq_transport import ZmqTransport

ROLLOUT = ComponentId("rollout")
PROMPTS = EdgeId("prompts")
CONSUMERS = {PROMPTS: [ROLLOUT]}


def item(i: int | str, **kw: object) -> Item:
    """An item on the prompts edge."""
    return Item(
        id=ItemId(f"i{i}"), group=GroupId(f"g{i}"), edge=PROMPTS, payload=f"p{i}".encode(), **kw
    )


def worker(name: str, capacity: int, slots: int = 0) -> WorkerState:
    """A rollout worker as the placement sees it, with a FIFO queue of its own."""
    return WorkerState(
        PeerId(name.encode()),
        instance=InstanceId(name),
        component=ROLLOUT,
        capacity=capacity,
        queue=RequestQueue[Item](FifoOrder(), max_size=100, clock=ManualClock()),
        now_s=0.0,
        sticky_max_queued=64,
        kv_full=0.95,
        slots=slots,
    )


def start(w: WorkerState) -> None:
    """What the router's pump does: move queued items in flight, up to capacity."""
    for it in w.queue.get_batch_nowait(w.capacity - len(w.in_flight)):
        w.in_flight.add(it)


class CheckedGraph:
    """Applies every router event to a real hypergraph (which rejects an inconsistent
    one) and keeps them for assertions."""

    def __init__(self, instances: list[str]) -> None:
        spec = PipelineSpec(
            components=(ComponentSpec(id=ROLLOUT, kind="rollout"),),
            edges=(EdgeSpec(id=PROMPTS, producer=None, consumers=(ROLLOUT,)),),
        )
        placement = {
            ROLLOUT: [
                InstanceSpec(id=InstanceId(n), devices=(DeviceId(k),))
                for k, n in enumerate(instances)
            ]
        }
        self.graph = Hypergraph(spec, num_devices=len(instances), placement=placement)
        self.events: list[ev.Event] = []
        self.recording = True

    def __call__(self, event: ev.Event) -> None:
        self.graph.apply(event)
        if self.recording:
            self.events.append(event)

    def of(self, kind: type[ev.Event]) -> list[ev.Event]:
        """Events of one type."""
        return [e for e in self.events if isinstance(e, kind)]

    def check(self) -> None:
        """Every hypergraph invariant holds."""
        self.graph.check()


class Net:
    """Makes connected transport ends of one kind and closes them at the end."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self._tmp = tmp
        self._inproc = InProcNetwork(max_buffered_frames=64)
        self._ends: list[Transport] = []
        self._serial = 0

    def bind(self) -> Transport:
        self._serial += 1
        end: Transport
        if self.kind == "inproc":
            end = self._inproc.bind(f"r{self._serial}")
        elif self.kind == "zmq-tcp":
            end = ZmqTransport.bind("tcp://127.0.0.1:*", hwm=64)
        else:
            end = ZmqTransport.bind(f"ipc://{self._tmp}/r{self._serial}.sock", hwm=64)
        self._ends.append(end)
        return end

    def connect(self, server: Transport) -> Transport:
        end: Transport
        if self.kind == "inproc":
            end = self._inproc.connect(server.address.removeprefix("inproc://"))
        else:
            end = ZmqTransport.connect(server.address, hwm=64)
        self._ends.append(end)
        return end

    async def aclose(self) -> None:
        for end in reversed(self._ends):
            await end.aclose()


async def echo(
    link: WorkerLink, *, delay_s: float = 0.0, status: Callable[[Item], str] = lambda it: "done"
) -> None:
    """Serve items until the link is lost: each result's payload names the server."""
    try:
        while True:
            for it in await link.receive():
                if delay_s:
                    await anyio.sleep(delay_s)
                link.complete(
                    ItemResult(
                        item=it.id,
                        status=status(it),
                        payload=it.payload + b"@" + link.instance.encode(),
                        num_tokens=1,
                        prefix_tokens=it.prefix_tokens + 10,
                    )
                )
    except PeerLostError:
        pass


class Cluster:
    """A router with in-process-task workers, over one kind of transport."""

    def __init__(
        self,
        router: Router,
        graph: CheckedGraph,
        net: Net,
        server: Transport,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        self.router = router
        self.graph = graph
        self.net = net
        self.server = server
        self._tg = tg
        self.scopes: dict[str, anyio.CancelScope] = {}
        self.links: dict[str, WorkerLink] = {}

    def add_worker(
        self,
        name: str,
        *,
        capacity: int = 4,
        serve: Callable[[WorkerLink], Awaitable[None]] | None = None,
    ) -> None:
        """Start a worker task serving with ``serve`` (default: :func:`echo`)."""
        scope = self.scopes[name] = anyio.CancelScope()
        transport = self.net.connect(self.server)

        async def run() -> None:
            with scope:
                async with open_worker_link(
                    transport, instance=InstanceId(name), component=ROLLOUT, capacity=capacity
                ) as link:
                    self.links[name] = link
                    await (serve or echo)(link)

        self._tg.start_soon(run)

    async def picked_up(self, worker: str, num: int) -> None:
        """Wait until ``worker``'s serving loop holds ``num`` items it took from its link:
        an item still in the link's inbox when an abort lands goes back untouched (see
        ``WorkerLink``), before the worker could add its tokens."""

        def taken() -> bool:
            link = self.links.get(worker)
            stats = link.statistics() if link is not None else None
            return stats is not None and stats.num_held == num and stats.num_waiting == 0

        await wait_until(taken)

    async def collect(self, num: int, timeout_s: float = 10.0) -> list[RoutedResult]:
        """The next ``num`` completions."""
        out: list[RoutedResult] = []
        with anyio.fail_after(timeout_s):
            while len(out) < num:
                out += await self.router.receive_batch()
        return out


@asynccontextmanager
async def cluster(
    net: Net,
    names: list[str],
    *,
    all_instances: list[str] | None = None,
    capacity: int = 4,
    **router_kw: Any,
) -> AsyncIterator[Cluster]:
    """A router and echo workers ``names`` (the hypergraph knows ``all_instances``)."""
    graph = CheckedGraph(all_instances or names)
    server = net.bind()
    router = Router(server, consumers=CONSUMERS, on_event=graph, **router_kw)
    async with router, task_group() as tg:
        c = Cluster(router, graph, net, server, tg)
        for name in names:
            c.add_worker(name, capacity=capacity)
        with anyio.fail_after(10):
            await router.wait_for_instances(len(names))
        yield c
        graph.recording = False  # workers leaving at teardown are not the test's business
        tg.cancel_scope.cancel()


async def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until it holds (for states no event announces)."""
    with anyio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.005)
