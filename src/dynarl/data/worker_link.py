"""The worker's end of the data plane: hello, items in, results out, liveness.

``async with open_worker_link(transport, ...) as link`` says hello (raising
:class:`~dynarl.data.errors.ProtocolVersionError` if the controller speaks another
protocol version), then runs the link's tasks: it answers pings, collects items, sends
results in batches (every result already waiting goes out in one frame), hands
aborted items back, and notices when the controller goes silent. The worker's own
loop only calls :meth:`WorkerLink.receive` and :meth:`WorkerLink.complete`; a worker
that serves typed calls too (:mod:`dynarl.workers.main`) takes them with
:meth:`WorkerLink.receive_call` and answers with :meth:`WorkerLink.reply`.
"""

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from dynarl.control import events as ev
from dynarl.core.clock import Clock, LoopClock
from dynarl.core.ids import ComponentId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data._tasks import task_group
from dynarl.data.codec import DEFAULT_MAX_FRAME_BYTES, Codec, Rejections, worker_codec
from dynarl.data.errors import (
    DataPlaneError,
    HelloRefusedError,
    PeerLostError,
    ProtocolError,
    ProtocolVersionError,
    UnauthorizedError,
)
from dynarl.data.transport import CONTROLLER, Transport

logger = logging.getLogger(__name__)


class LinkStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one worker link."""

    num_received: int
    num_completed: int
    num_held: int
    num_waiting: int
    rejected: dict[str, int]


class WorkerLink:
    """A connected worker's link to the controller (see :func:`open_worker_link`)."""

    def __init__(
        self,
        transport: Transport,
        codec: Codec[wire.AnyToWorker],
        welcome: wire.Welcome,
        clock: Clock,
        max_batch_items: int,
    ) -> None:
        self._transport = transport
        self._codec = codec
        self.welcome = welcome
        """The controller's answer to hello (instance, heartbeat timing)."""
        self._clock = clock
        self._max_batch_items = max_batch_items
        self._inbox: deque[wire.Item] = deque()
        self._calls: deque[wire.Call] = deque()
        self._has_calls = anyio.Event()
        self._held: dict[ItemId, wire.Item] = {}
        self._aborting: set[ItemId] = set()
        self._new_aborts: list[ItemId] = []
        self._has_aborts = anyio.Event()
        self._ended: list[ItemId] = []
        self._has_ended = anyio.Event()
        self._outbox: list[wire.ItemResult] = []
        self._has_items = anyio.Event()
        self._has_results = anyio.Event()
        self._last_heard_s = clock.now()
        self._lost: PeerLostError | None = None
        self._num_received = 0
        self._num_completed = 0
        self._handlers: dict[type[Any], Any] = {
            wire.Work: lambda m: self._accept((m.item,)),
            wire.WorkBatch: lambda m: self._accept(m.items),
            wire.Abort: self._on_abort,
            wire.EndSessions: self._on_end_sessions,
            wire.Ping: self._on_ping,
            wire.Call: self._on_call,
            wire.Retire: lambda m: self._lose(
                f"the controller retired this worker: {m.reason}",
                expected=True,
                reconnect=m.reconnect,
            ),
            wire.Refused: lambda m: self._lose(f"the controller dropped this worker: {m.reason}"),
            wire.Welcome: lambda m: self._codec.rejections.add("unexpected", "second welcome"),
        }

    @property
    def instance(self) -> InstanceId:
        """The instance this worker runs."""
        return self.welcome.instance

    # ------------------------------------------------------------------ worker API

    async def receive(self) -> list[wire.Item]:
        """Wait for items; return every item waiting (in arrival order).

        Raises :class:`PeerLostError` once the controller is gone, has retired this
        worker or declared it failed.
        """
        while not self._inbox:
            if self._lost is not None:
                raise self._lost
            self._has_items = anyio.Event()
            await self._has_items.wait()
        return self.receive_nowait()

    def receive_nowait(self) -> list[wire.Item]:
        """Every item waiting now (possibly none)."""
        items = list(self._inbox)
        self._inbox.clear()
        return items

    def complete(self, result: wire.ItemResult) -> None:
        """Hand an item back (done, out on a tool call, or aborted with its partial
        output). Buffered and sent by the link; never waits. Raises
        :class:`ProtocolError` if this worker does not hold the item."""
        if self._held.pop(result.item, None) is None:
            raise ProtocolError(
                f"{self.instance!r} completed {result.item!r}, which it does "
                f"not hold (completed twice, or never received)"
            )
        self._aborting.discard(result.item)
        self._outbox.append(result)
        self._num_completed += 1
        self._has_results.set()

    async def receive_call(self) -> wire.Call:
        """Wait for the controller's next call (in arrival order).

        Raises :class:`PeerLostError` once the controller is gone, has retired this
        worker or declared it failed.
        """
        while not self._calls:
            if self._lost is not None:
                raise self._lost
            self._has_calls = anyio.Event()
            await self._has_calls.wait()
        return self._calls.popleft()

    async def reply(self, corr: int, body: bytes, *, more: bool = False) -> None:
        """Answer call ``corr``; ``more`` if further answers follow."""
        await self._transport.send(CONTROLLER, self._codec.encode(wire.Reply(corr, body, more)))

    async def receive_aborts(self) -> list[ItemId]:
        """Wait until the controller asks for items this worker is working on back;
        return their ids, each once (hand each back soon with status ``aborted`` and
        its partial output). Items not picked up yet went back already.

        Raises :class:`PeerLostError` once the controller is gone, has retired this
        worker or declared it failed.
        """
        while not self._new_aborts:
            if self._lost is not None:
                raise self._lost
            self._has_aborts = anyio.Event()
            await self._has_aborts.wait()
        wanted, self._new_aborts = self._new_aborts, []
        return [item for item in wanted if item in self._aborting]

    async def receive_ended_sessions(self) -> list[ItemId]:
        """Wait until the controller says multi-turn sessions this worker served are
        over; return their ids (drop what is kept for them between turns, such as a
        cached KV prefix).

        Raises :class:`PeerLostError` once the controller is gone, has retired this
        worker or declared it failed.
        """
        while not self._ended:
            if self._lost is not None:
                raise self._lost
            self._has_ended = anyio.Event()
            await self._has_ended.wait()
        ended, self._ended = self._ended, []
        return ended

    def abort_requested(self, item: ItemId) -> bool:
        """Whether the controller asked for ``item`` back (hand it back soon with
        status ``aborted`` and its partial output)."""
        return item in self._aborting

    async def report(self, event: ev.AnyEvent) -> None:
        """Tell the controller about an event (engine stats, a train step)."""
        await self._transport.send(CONTROLLER, self._codec.encode(wire.Report(event)))

    def statistics(self) -> LinkStatistics:
        """Items received, completed, held and waiting; rejected frames by kind."""
        return LinkStatistics(
            num_received=self._num_received,
            num_completed=self._num_completed,
            num_held=len(self._held),
            num_waiting=len(self._inbox),
            rejected=dict(self._codec.rejections.counts),
        )

    # ------------------------------------------------------------------ tasks

    async def _receive_loop(self) -> None:
        decode, handlers = self._codec.decode, self._handlers
        while self._lost is None:
            frames = await self._transport.receive_batch(256)
            self._last_heard_s = self._clock.now()
            for _, frame in frames:
                msg = decode(frame)
                if msg is not None:
                    handlers[type(msg)](msg)

    async def _send_loop(self) -> None:
        while True:
            await self._has_results.wait()
            self._has_results = anyio.Event()
            results, self._outbox = self._outbox, []
            n = self._max_batch_items
            for i in range(0, len(results), n):
                chunk = results[i : i + n]
                msg = wire.Done(chunk[0]) if len(chunk) == 1 else wire.DoneBatch(tuple(chunk))
                await self._transport.send(CONTROLLER, self._codec.encode(msg))

    async def _watchdog(self) -> None:
        timeout_s = self.welcome.liveness_timeout_s
        while self._lost is None:
            await self._clock.sleep(self.welcome.heartbeat_interval_s)
            silent_s = self._clock.now() - self._last_heard_s
            if silent_s > timeout_s:
                self._lose(f"the controller has been silent for {silent_s:.2f} s")

    # ------------------------------------------------------------------ handlers

    def _accept(self, items: tuple[wire.Item, ...]) -> None:
        for item in items:
            self._held[item.id] = item
        self._inbox.extend(items)
        self._num_received += len(items)
        self._has_items.set()

    def _on_abort(self, msg: wire.Abort) -> None:
        wanted = {i for i in msg.items if i in self._held}
        # Items the worker has not picked up yet go back untouched, right away.
        for item in [it for it in self._inbox if it.id in wanted]:
            self._inbox.remove(item)
            self.complete(
                wire.ItemResult(
                    item=item.id,
                    status="aborted",
                    payload=item.payload,
                    prefix_tokens=item.prefix_tokens,
                )
            )
            wanted.discard(item.id)
        self._aborting |= wanted
        if wanted:
            self._new_aborts.extend(sorted(wanted))
            self._has_aborts.set()

    def _on_end_sessions(self, msg: wire.EndSessions) -> None:
        self._ended.extend(msg.items)
        self._has_ended.set()

    def _on_call(self, msg: wire.Call) -> None:
        self._calls.append(msg)
        self._has_calls.set()

    def _on_ping(self, msg: wire.Ping) -> None:
        # If the controller is not reading, it does not count our silence either.
        with contextlib.suppress(anyio.WouldBlock):
            self._transport.send_nowait(CONTROLLER, self._codec.encode(wire.Pong(msg.corr)))

    def _lose(self, reason: str, *, expected: bool = False, reconnect: bool = False) -> None:
        if self._lost is None:
            # A retirement is the controller's decision (shutdown, a role switch).
            level = logging.INFO if expected else logging.WARNING
            logger.log(level, "link of %s lost: %s", self.instance, reason)
            self._lost = PeerLostError(reason, reconnect=reconnect)
            self._has_items.set()
            self._has_calls.set()
            self._has_aborts.set()
            self._has_ended.set()


@asynccontextmanager
async def open_worker_link(
    transport: Transport,
    *,
    instance: InstanceId,
    component: ComponentId,
    capacity: int,
    clock: Clock | None = None,
    hello_timeout_s: float = 30.0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_batch_items: int = 256,
    token: str = "",
    slots: int = 0,
) -> AsyncIterator[WorkerLink]:
    """Say hello as ``instance`` of ``component`` taking up to ``capacity`` items at
    once and running ``slots`` of them (0: all), presenting the run's ``token``, and run
    the link while the block runs; on exit, say bye (the controller then routes
    whatever this worker still holds elsewhere).

    Raises :class:`ProtocolVersionError`, :class:`UnauthorizedError` (wrong token) or
    :class:`HelloRefusedError` if the controller refuses, :class:`PeerLostError` if it
    does not answer within ``hello_timeout_s``. The caller owns and closes ``transport``.
    """
    clock = clock or LoopClock()
    codec = worker_codec(Rejections(f"worker {instance}"), max_frame_bytes=max_frame_bytes)
    hello = wire.Hello(wire.PROTOCOL_VERSION, instance, component, capacity, token, slots)
    await transport.send(CONTROLLER, codec.encode(hello))
    welcome = await _await_welcome(transport, codec, hello_timeout_s)
    link = WorkerLink(transport, codec, welcome, clock, max_batch_items)
    async with task_group() as tg:
        tg.start_soon(link._receive_loop)
        tg.start_soon(link._send_loop)
        tg.start_soon(link._watchdog)
        try:
            yield link
        finally:
            tg.cancel_scope.cancel()
            if link._lost is None:
                # Flush results the send loop had no chance to send, then leave.
                frames = [codec.encode(wire.Done(r)) for r in link._outbox]
                frames.append(codec.encode(wire.Bye("the worker closed its link")))
                try:
                    for frame in frames:
                        transport.send_nowait(CONTROLLER, frame)
                except (anyio.WouldBlock, anyio.ClosedResourceError, DataPlaneError):
                    pass  # the controller's liveness check will notice


_REFUSALS: dict[str, type[ProtocolError]] = {
    "version": ProtocolVersionError,
    "auth": UnauthorizedError,
}


async def _await_welcome(
    transport: Transport, codec: Codec[wire.AnyToWorker], timeout_s: float
) -> wire.Welcome:
    with anyio.move_on_after(timeout_s):
        while True:
            # One frame at a time: whatever follows the welcome is the link's to handle.
            for _, frame in await transport.receive_batch(1):
                msg = codec.decode(frame)
                if isinstance(msg, wire.Welcome):
                    return msg
                if isinstance(msg, wire.Refused):
                    error = _REFUSALS.get(msg.code, HelloRefusedError)
                    raise error(f"the controller refused this worker: {msg.reason}")
    raise PeerLostError(
        f"no answer to hello from {transport.address} within "
        f"{timeout_s} s: is the controller running there?"
    )
