"""The ZeroMQ transport: the controller's ROUTER and each worker's DEALER.

Endpoints are ``tcp://HOST:PORT`` (``tcp://127.0.0.1:*`` picks a free port) or
``ipc://PATH``. High-water marks bound every pipe; the ROUTER is ``ROUTER_MANDATORY``,
so a full pipe makes the sender wait (never drops) and a frame for a vanished peer
raises :class:`~dynarl.data.errors.PeerUnreachableError`.

Fast paths avoid one await per frame: sends and receives are tried non-blocking on a
synchronous shadow of the ``zmq.asyncio`` socket first, and ``receive_batch`` drains
every frame already waiting after its one await.
"""

import logging
import uuid
from typing import Any

import anyio
import zmq
import zmq.asyncio

from dynarl.data.errors import DataPlaneError, PeerUnreachableError
from dynarl.data.transport import CONTROLLER, PeerId, TransportStatistics

logger = logging.getLogger(__name__)

DEFAULT_HWM = 1000
"""Default high-water mark (frames per pipe and direction)."""

_MAX_BACKOFF_S = 0.01


class ZmqTransport:
    """One ZeroMQ end; implements :class:`~dynarl.data.transport.Transport`.

    Build it with :meth:`bind` (the controller) or :meth:`connect` (a worker). It owns
    its own ``zmq.asyncio.Context`` (no process-wide singleton) and must be closed with
    :meth:`aclose`.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket, *, is_router: bool, address: str
    ) -> None:
        self._ctx = ctx
        self._sock = sock
        self._sync: Any = zmq.Socket.shadow(sock.underlying)
        # Operations on the shadow may consume the edge-triggered ZeroMQ FD signal that a
        # pending asyncio wait relies on; this makes the asyncio socket look again
        # (pyzmq does the same after its own short-circuited sends).
        self._recheck: Any = getattr(sock, "_schedule_remaining_events", lambda: None)
        self._is_router = is_router
        self._address = address
        self.closed = False
        self._frames_sent = self._frames_received = self._frames_rejected = 0
        self._bytes_sent = self._bytes_received = 0

    @classmethod
    def bind(cls, endpoint: str, *, hwm: int = DEFAULT_HWM) -> "ZmqTransport":
        """The controller's end: a ROUTER bound to ``endpoint``."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.bind(endpoint)
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            ctx.term()
            raise DataPlaneError(f"cannot bind the router to {endpoint!r}: {e}") from e
        return cls(ctx, sock, is_router=True, address=address)

    @classmethod
    def connect(cls, endpoint: str, *, hwm: int = DEFAULT_HWM) -> "ZmqTransport":
        """A worker's end: a DEALER connected to ``endpoint`` (it may connect before the
        controller binds; frames wait until the connection is up)."""
        if "#" in endpoint:
            raise DataPlaneError(
                f"{endpoint!r} is a worker endpoint with a run token: connect to its address "
                f"(dynarl.data.endpoint.split_endpoint) and present the token in the hello"
            )
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # A stable routing id lets a reconnect take over its old pipe (HANDOVER).
            sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            ctx.term()
            raise DataPlaneError(f"cannot connect a worker to {endpoint!r}: {e}") from e
        return cls(ctx, sock, is_router=False, address=endpoint)

    @property
    def address(self) -> str:
        """The endpoint, with the actual port when bound to a wildcard."""
        return self._address

    def _parts(self, peer: PeerId, frame: bytes) -> list[bytes]:
        return [peer, frame] if self._is_router else [frame]

    def send_nowait(self, peer: PeerId, frame: bytes) -> None:
        """See :meth:`Transport.send_nowait`."""
        if self.closed:
            raise anyio.ClosedResourceError
        try:
            self._sync.send_multipart(self._parts(peer, frame), flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            raise anyio.WouldBlock from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachableError(
                    f"{self._address}: peer {peer!r} is not connected"
                ) from None
            raise
        self._recheck()
        self._frames_sent += 1
        self._bytes_sent += len(frame)

    async def send(self, peer: PeerId, frame: bytes) -> None:
        """See :meth:`Transport.send`."""
        backoff_s = 5e-5
        while True:
            try:
                self.send_nowait(peer, frame)
                return
            except anyio.WouldBlock:
                pass
            if not self._is_router:
                await self._sock.send_multipart([frame])
                self._frames_sent += 1
                self._bytes_sent += len(frame)
                return
            # A ROUTER reports POLLOUT when *any* peer can take a frame, so waiting on it
            # could spin; back off instead until this peer's pipe has room.
            await anyio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _MAX_BACKOFF_S)

    async def receive_batch(self, max_frames: int) -> list[tuple[PeerId, bytes]]:
        """See :meth:`Transport.receive_batch`."""
        if self.closed:
            raise anyio.ClosedResourceError
        out: list[tuple[PeerId, bytes]] = []
        while not out:  # messages with bad framing are dropped: wait for a good one
            try:
                parts: list[bytes] = await self._sock.recv_multipart()
            except zmq.ZMQError as e:
                if self.closed or e.errno == zmq.ENOTSOCK:
                    raise anyio.ClosedResourceError from None
                raise
            self._accept(parts, out)
            for _ in range(max_frames - 1):
                try:
                    parts = self._sync.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._accept(parts, out)
            self._recheck()
        return out

    def _accept(self, parts: list[bytes], out: list[tuple[PeerId, bytes]]) -> None:
        expected = 2 if self._is_router else 1
        if len(parts) != expected:
            self._frames_rejected += 1
            if self._frames_rejected == 1:
                logger.warning(
                    "%s dropped a message of %d parts (expected %d); further ones are only counted",
                    self._address,
                    len(parts),
                    expected,
                )
            return
        frame = parts[-1]
        self._frames_received += 1
        self._bytes_received += len(frame)
        out.append((PeerId(parts[0]) if self._is_router else CONTROLLER, frame))

    async def aclose(self) -> None:
        """See :meth:`Transport.aclose`."""
        if self.closed:
            return
        self.closed = True
        self._sock.close(linger=0)
        self._ctx.term()
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> TransportStatistics:
        """See :meth:`Transport.statistics`."""
        return TransportStatistics(
            frames_sent=self._frames_sent,
            frames_received=self._frames_received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            frames_rejected=self._frames_rejected,
        )
