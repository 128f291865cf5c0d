"""The data router: the controller's end of the data plane.

It accepts workers (hello, version check), watches their liveness (pings; silence or a
vanished peer makes a ``WorkerFailed`` event), routes every item to an instance by its
affinity and load (:mod:`dynarl.data.routing`) into that instance's request queue
(:mod:`dynarl.data.request_queue`), feeds each worker from its queue within the
worker's capacity (batching items into one frame), and hands results to the caller
(:mod:`dynarl.data.delivery`).

Every routing decision is reported as a control-plane event, in an order the
hypergraph accepts: ``ItemsEnqueued`` (submitted), ``ItemRouted`` (put in an
instance's queue), ``ToolCallStarted`` / ``ToolCallFinished`` (a session leaves for a
tool and comes back), ``ItemsRequeued`` (taken back from a draining instance),
``ItemsWithdrawn`` (taken out of the run unfinished: a partial rollout's end, see
:meth:`Router.withdraw`), ``ItemCompleted``, ``WorkerIdle`` (an instance left with
nothing it could take) and ``WorkerFailed`` (whose items the hypergraph puts back in
the queue; the router then routes them again). No item is lost or delivered twice: a
result counts only from the instance that holds the item.

Memory is bounded: instance queues and the backlog (items no instance can take now)
have fixed sizes, ``submit`` waits while the backlog is full, and a consumer that does
not read results stops the router reading frames, which stops the workers (ZeroMQ
high-water marks), which stops taking items.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Self

import anyio
import anyio.abc

from dynarl.control import events as ev
from dynarl.core.clock import Clock, LoopClock
from dynarl.core.ids import ComponentId, EdgeId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data._tasks import task_group
from dynarl.data.calls import Call
from dynarl.data.codec import Rejections, controller_codec
from dynarl.data.delivery import ResultDelivery
from dynarl.data.endpoint import worker_endpoint
from dynarl.data.errors import RoutingError
from dynarl.data.peers import RouterConfig, RouterStatistics, WorkerState
from dynarl.data.placement import Placement, RoutedResult
from dynarl.data.request_order import FifoOrder, RequestOrder
from dynarl.data.routing import AffinityRouting, RoutingPolicy
from dynarl.data.sessions import Sessions
from dynarl.data.transport import Transport

logger = logging.getLogger(__name__)


class Router:
    """Routes items to workers over a transport; use as ``async with Router(...)``.

    Args:
        transport: the controller's end (bound); the caller owns and closes it, after
            the router has exited.
        consumers: the components that consume each edge (from the pipeline spec).
        config: timeouts, sizes and batching.
        order: the request order of every instance's queue (default FIFO).
        policy: the routing policy (default :class:`AffinityRouting`).
        on_event: receives every control-plane event, synchronously, in order (e.g.
            ``hypergraph.apply``).
        clock: where time comes from (default the event loop's).
        token: the run's token (:mod:`dynarl.data.endpoint`): a hello without it is
            refused and counted (``rejected["unauthorized"]``); ``None``: none asked.
        advertised_address: the address workers dial (default the transport's).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        consumers: Mapping[EdgeId, Iterable[ComponentId]],
        config: RouterConfig | None = None,
        order: RequestOrder | None = None,
        policy: RoutingPolicy | None = None,
        on_event: Callable[[ev.Event], object] | None = None,
        clock: Clock | None = None,
        token: str | None = None,
        advertised_address: str | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self._token = token
        self._advertised = advertised_address
        self._transport = transport
        self._order = order or FifoOrder()
        self._clock = clock or LoopClock()
        self._placement = Placement(
            consumers,
            policy=policy or AffinityRouting(),
            emit=on_event or (lambda e: None),
            balance_on_join=self.config.balance_on_join,
            balance_below_share=self.config.balance_below_share,
            recall=self._recall,
            lost=self._hand_back,
        )
        self.rejections = Rejections("router")
        self._codec = controller_codec(self.rejections, max_frame_bytes=self.config.max_frame_bytes)
        self._delivery = ResultDelivery(
            transport, self._placement, self.rejections, clock=self._clock, config=self.config
        )
        self._sessions = Sessions(
            transport,
            self._codec,
            config=self.config,
            order=self._order,
            clock=self._clock,
            placement=self._placement,
            on_join=self._on_join,
            on_results=self._delivery.on_results,
            token=token,
        )
        self._backlog_space = anyio.Event()
        self.results = self._delivery.stream
        """Completions in arrival order (a memory object stream); see also
        :meth:`receive_batch`."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack = contextlib.AsyncExitStack()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        self._stack = contextlib.AsyncExitStack()
        async with contextlib.AsyncExitStack() as stack:
            self._tg = await stack.enter_async_context(task_group())
            self._tg.start_soon(self._delivery.receive_loop, self._sessions)
            self._tg.start_soon(self._sessions.heartbeat_loop)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._stack.__aexit__(*exc_info)
        finally:
            self._delivery.close()

    # ------------------------------------------------------------------ items

    async def submit(self, items: Sequence[wire.Item]) -> None:
        """Route new items, waiting while the backlog is full.

        Raises :class:`RoutingError` (routing none of them) if an item's edge has no
        consumer or its id is already pending.
        """
        p = self._placement
        p.check_new(items)
        start = 0
        while start < len(items):
            room = self.config.max_backlog_items - len(p.backlog)
            if room <= 0:
                await self._wait_backlog_space()
                continue
            chunk = items[start : start + room]
            p.admit(chunk, self._clock.now())
            start += len(chunk)
        await anyio.lowlevel.checkpoint()

    def submit_nowait(self, items: Sequence[wire.Item]) -> None:
        """Route new items now, or raise ``anyio.WouldBlock`` (routing none) if the
        backlog could not take them all; otherwise as :meth:`submit`."""
        p = self._placement
        p.check_new(items)
        if len(p.backlog) + len(items) > self.config.max_backlog_items:
            raise anyio.WouldBlock
        p.admit(items, self._clock.now())

    async def resume(
        self, item_id: ItemId, payload: bytes, *, latency_s: float = 0.0, ok: bool = True
    ) -> None:
        """Route the next turn of a session back from a tool call: ``payload`` is its
        new context; by its affinity it returns to the instance that holds its prefix
        while that instance lives and has room."""
        if item_id not in self._placement.in_tool:
            raise RoutingError(f"item {item_id!r} is not out on a tool call")
        while len(self._placement.backlog) >= self.config.max_backlog_items:
            await self._wait_backlog_space()
        self._placement.resume(item_id, payload, self._clock.now(), latency_s=latency_s, ok=ok)

    def finish(self, item_id: ItemId) -> None:
        """End a session that is out on a tool call: its environment says the episode
        is over. It completes (``ItemCompleted``) on the instance of its last turn, and
        that instance, if it is still connected, is told to drop what it keeps for the
        session (:class:`~dynarl.data.wire.EndSessions`: its cached KV prefix)."""
        instance = self._placement.finish(item_id, self._clock.now())
        w = self._placement.workers.get(instance)
        if w is not None:
            self._sessions.send_nowait(w.peer, wire.EndSessions((item_id,)))

    def withdraw(self, item_ids: Iterable[ItemId]) -> list[wire.Item]:
        """Take pending items out of the run without completing them (a partial
        rollout's iteration has the groups it trains; these carry over to the next,
        where :meth:`submit` takes them again, with the same ids).

        Those waiting (in the backlog, an instance's queue, out on a tool call) leave
        now and are returned, each with its payload as it stands (the partial output
        of an item aborted before). Those in flight are asked back (``Abort``) and
        arrive later through :meth:`receive_batch` with status ``aborted``, their
        partial output as their payload; one that finishes first arrives as usual (a
        session whose turn ended arrives ``tool_call``, out of the run all the same),
        and one whose worker fails meanwhile arrives ``aborted`` with the payload it
        was sent with (what it generated there is lost with the worker). An item that is
        no longer pending is left alone: its result was delivered, or is on its way.
        Each leaving item is reported (``ItemsWithdrawn``)."""
        p = self._placement
        taken = p.withdraw(p.pending.intersection(item_ids), self._clock.now())
        if len(p.backlog) < self.config.max_backlog_items:
            self._backlog_space.set()
        return taken

    def out_on_tool_call(self, item_ids: Iterable[ItemId]) -> set[ItemId]:
        """The sessions among ``item_ids`` out on a tool call now: their turn's result
        was handed over, or is on its way through :meth:`receive_batch`."""
        return self._placement.in_tool.keys() & set(item_ids)

    async def _wait_backlog_space(self) -> None:
        self._backlog_space = anyio.Event()
        await self._backlog_space.wait()

    async def receive_batch(self, max_items: int = 1024) -> list[RoutedResult]:
        """Wait for at least one completion; return up to ``max_items`` of those
        already waiting (one await for many results)."""
        return await self._delivery.receive_batch(max_items)

    # ------------------------------------------------------------------ instances

    async def wait_for_instances(self, num_instances: int) -> None:
        """Wait until at least ``num_instances`` workers have said hello and live."""
        while len(self._placement.workers) < num_instances:
            await self._next_join()

    async def wait_for_instance(self, instance: InstanceId) -> None:
        """Wait until ``instance`` has said hello (returns at once if it is connected)."""
        while instance not in self._placement.workers:
            await self._next_join()

    async def _next_join(self) -> None:
        # Waiters share one event; whoever finds it set replaces it, so that several
        # can wait at once.
        if self._sessions.joined.is_set():
            self._sessions.joined = anyio.Event()
        await self._sessions.joined.wait()

    @property
    def address(self) -> str:
        """Where workers connect: the transport's address (with the actual port)."""
        return self._transport.address

    @property
    def endpoint(self) -> str:
        """What a worker is started with: the advertised address and the run's token
        (see :func:`~dynarl.data.endpoint.worker_endpoint`)."""
        return worker_endpoint(self._advertised or self._transport.address, self._token or "")

    @property
    def instances(self) -> list[InstanceId]:
        """Connected instances, active or draining."""
        return list(self._placement.workers)

    def workers_of(self, component: ComponentId) -> tuple[list[InstanceId], list[InstanceId]]:
        """``component``'s connected instances: those it routes to, and the others
        (drained or held)."""
        active: list[InstanceId] = []
        idle: list[InstanceId] = []
        for instance, w in self._placement.workers.items():
            if w.component == component:
                (active if w.active else idle).append(instance)
        return active, idle

    async def drain(self, instance: InstanceId, *, abort: bool = True) -> None:
        """Stop routing to ``instance``, route its queued items elsewhere and wait until
        it holds nothing; with ``abort``, ask it to hand in-flight items back now (they
        are routed elsewhere with their partial output). Returns early if it fails."""
        w = self._worker(instance)
        self._placement.set_active(w, False, self._clock.now())
        self._backlog_space.set()
        if abort and w.in_flight:
            await self._sessions.send(w, wire.Abort(tuple(w.in_flight)))
        w.check_idle()
        await w.idle.wait()

    def reactivate(self, instance: InstanceId) -> None:
        """Route to a drained instance again (its migration failed), or to a held one
        (see :meth:`hold`), also before it joined."""
        p = self._placement
        if instance in p.held and instance not in p.workers:
            p.held.discard(instance)
            return
        p.set_active(self._worker(instance), True, self._clock.now())

    def hold(self, instance: InstanceId) -> None:
        """Route nothing to ``instance`` until :meth:`reactivate`, also once it joins:
        an instance a migration creates takes work only once the controller placed it."""
        self._placement.held.add(instance)
        if instance in self._placement.workers:
            self._placement.set_active(self._worker(instance), False, self._clock.now())

    async def retire(
        self, instance: InstanceId, reason: str = "retired", *, reconnect: bool = False
    ) -> None:
        """Forget a drained instance that holds nothing and tell its worker to close its
        link (the hypergraph removes it on ``MigrationDone``): to stop, or with
        ``reconnect`` to connect again as the instance it was told to become."""
        w = self._worker(instance)
        if w.active or w.in_flight or len(w.queue):
            raise RoutingError(f"drain {instance!r} before retiring it")
        self._sessions.forget(w)
        await self._sessions.send(w, wire.Retire(reason, reconnect=reconnect))

    def fail(self, instance: InstanceId, reason: str) -> None:
        """Declare ``instance``'s worker failed now, as the liveness watch would after
        its timeout: its launcher saw its process end. Its items are routed elsewhere
        (``WorkerFailed``). Does nothing if it is not connected."""
        w = self._placement.workers.get(instance)
        if w is not None:
            self._sessions.fail(w, reason, self._clock.now())

    async def ping(self, instance: InstanceId) -> float:
        """Round-trip time to ``instance``'s worker in seconds (a correlated request:
        the reply carries the request's ``corr``)."""
        start_s = self._clock.now()
        async with self._open(instance, wire.Ping) as call:
            await call.receive()
        return self._clock.now() - start_s

    async def call(self, instance: InstanceId, body: bytes) -> bytes:
        """Send ``body`` to ``instance``'s worker as a :class:`~dynarl.data.wire.Call`
        and return the body of its (last) reply.

        Raises :class:`RoutingError` if the instance is not connected,
        :class:`~dynarl.data.errors.PeerLostError` if it goes away before replying.
        """
        async with self.open_call(instance, body) as call:
            last = await call.receive()
            async for more in call:
                last = more
            return last

    @contextlib.asynccontextmanager
    async def open_call(self, instance: InstanceId, body: bytes) -> AsyncIterator[Call]:
        """Send ``body`` as a call and yield the :class:`~dynarl.data.calls.Call` that
        receives its replies (``async for reply in call``); leaving the block stops
        listening. For streamed replies; otherwise as :meth:`call`."""
        async with self._open(instance, lambda corr: wire.Call(corr, body)) as call:
            yield call

    @contextlib.asynccontextmanager
    async def _open(
        self, instance: InstanceId, message: Callable[[int], wire.ToWorker]
    ) -> AsyncIterator[Call]:
        w = self._worker(instance)
        calls = self._sessions.calls
        corr, call = calls.open(w)
        try:
            await self._sessions.send(w, message(corr))
            yield call
        finally:
            calls.close(corr)

    def holders(self, item_ids: Iterable[ItemId]) -> dict[ItemId, InstanceId]:
        """The instance holding each of ``item_ids`` now (queued or in flight there);
        items in no instance (in the backlog, out on a tool call, done) are absent."""
        wanted = set(item_ids)
        found: dict[ItemId, InstanceId] = {}
        for w in self._placement.workers.values():
            for item_id in [*w.in_flight, *(i.id for i in w.queue.queued())]:
                if item_id in wanted:
                    found[item_id] = w.instance
        return found

    def statistics(self) -> RouterStatistics:
        """Workers, items by state, counters, rejected input and per-queue statistics."""
        p = self._placement
        workers = list(p.workers.values())
        rejected = dict(self.rejections.counts)
        transport = self._transport.statistics()
        if transport.frames_rejected:
            rejected["framing"] = transport.frames_rejected
        return RouterStatistics(
            num_workers=len(workers),
            num_active=sum(w.active for w in workers),
            num_pending=len(p.pending),
            num_backlog=len(p.backlog),
            num_queued=sum(len(w.queue) for w in workers),
            num_in_flight=sum(len(w.in_flight) for w in workers),
            num_in_tool=len(p.in_tool),
            num_routed=p.num_routed,
            num_completed=p.num_completed,
            num_refused=p.num_refused,
            num_requeued=p.num_requeued,
            num_stolen=p.num_stolen,
            num_balanced=p.balancer.num_balanced,
            num_workers_failed=p.num_workers_failed,
            num_frames_unsent=self._sessions.num_frames_unsent,
            num_late_frames=self._sessions.num_late_frames,
            rejected=rejected,
            transport=transport,
            queues={w.instance: w.queue.statistics() for w in workers},
        )

    def _worker(self, instance: InstanceId) -> WorkerState:
        try:
            return self._placement.workers[instance]
        except KeyError:
            raise RoutingError(
                f"no connected instance {instance!r}; connected: {sorted(self._placement.workers)}"
            ) from None

    # ------------------------------------------------------------------ worker feed

    async def _run_pump(self, w: WorkerState) -> None:
        with w.scope:
            await self._pump(w)

    async def _pump(self, w: WorkerState) -> None:
        """Feed ``w`` from its queue, at most its capacity in flight, batched."""
        max_batch = self.config.max_batch_items
        p = self._placement
        while True:
            while len(w.in_flight) >= w.capacity:
                w.credit = anyio.Event()
                await w.credit.wait()
            try:
                batch = [await w.queue.get()]
            except anyio.EndOfStream:
                return
            batch += w.queue.get_batch_nowait(min(w.capacity - len(w.in_flight), max_batch) - 1)
            for item in batch:
                w.in_flight.add(item)
            if p.backlog:
                p.refill(self._clock.now())
                if len(p.backlog) < self.config.max_backlog_items:
                    self._backlog_space.set()
            msg = wire.Work(batch[0]) if len(batch) == 1 else wire.WorkBatch(tuple(batch))
            await self._sessions.send(w, msg)

    # ------------------------------------------------------------------ frames in

    def _recall(self, w: WorkerState, items: tuple[ItemId, ...], now: float) -> None:
        """Ask ``w`` for ``items`` back. For a balance (``Placement.balance_for`` moves
        them to a joining instance) a frame that cannot go now leaves them where they
        are; withdrawn items must come back, so their frame waits for room."""
        if items[0] in self._placement.withdrawing:
            assert self._tg is not None, "enter the router first"
            self._tg.start_soon(self._sessions.send, w, wire.Abort(items))
        else:
            self._sessions.send_nowait(w.peer, wire.Abort(items))

    def _hand_back(self, result: RoutedResult) -> None:
        """A withdrawn item whose worker failed before handing it back: its result."""
        self._delivery.hand_back(result)

    def _on_join(self, w: WorkerState) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._run_pump, w)
