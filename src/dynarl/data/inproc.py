"""The in-process transport: the transport interface over anyio memory streams.

For tests and the simulator: a :class:`InProcNetwork` names bound ends; workers
connect to them by name. Each end's inbox is a bounded memory stream, so a full inbox
makes its senders wait exactly as a ZeroMQ high-water mark does.
"""

import itertools

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dynarl.data.errors import DataPlaneError, PeerUnreachableError
from dynarl.data.transport import CONTROLLER, PeerId, TransportStatistics


class InProcNetwork:
    """A namespace of in-process endpoints; one per test or simulated cluster.

    Args:
        max_buffered_frames: inbox size of every end created here (the high-water
            mark).
    """

    def __init__(self, *, max_buffered_frames: int = 1000) -> None:
        if max_buffered_frames < 1:
            raise DataPlaneError(f"max_buffered_frames must be >= 1, not {max_buffered_frames}")
        self.max_buffered_frames = max_buffered_frames
        self._bound: dict[str, InProcTransport] = {}
        self._serial = itertools.count()

    def bind(self, name: str) -> "InProcTransport":
        """The controller's end, reachable as ``name``."""
        if name in self._bound and not self._bound[name].closed:
            raise DataPlaneError(f"in-process endpoint {name!r} is already bound")
        end = InProcTransport(self, name, None, self.max_buffered_frames)
        self._bound[name] = end
        return end

    def connect(self, name: str) -> "InProcTransport":
        """A worker's end, connected to the end bound as ``name``."""
        server = self._bound.get(name)
        if server is None or server.closed:
            raise PeerUnreachableError(f"no in-process endpoint is bound as {name!r}")
        peer = PeerId(f"inproc-{next(self._serial)}".encode())
        end = InProcTransport(self, name, server, self.max_buffered_frames, peer=peer)
        server._peers[peer] = end
        return end


class InProcTransport:
    """One end of an in-process pipe (see :class:`InProcNetwork`); implements
    :class:`~dynarl.data.transport.Transport`."""

    def __init__(
        self,
        network: InProcNetwork,
        name: str,
        server: "InProcTransport | None",
        max_buffered_frames: int,
        *,
        peer: PeerId = CONTROLLER,
    ) -> None:
        self._network = network
        self._name = name
        self._server = server
        self._peer = peer
        self._peers: dict[PeerId, InProcTransport] = {}
        send, receive = anyio.create_memory_object_stream[tuple[PeerId, bytes]](max_buffered_frames)
        self._inbox_send: MemoryObjectSendStream[tuple[PeerId, bytes]] = send
        self._inbox: MemoryObjectReceiveStream[tuple[PeerId, bytes]] = receive
        self.closed = False
        self._frames_sent = self._frames_received = 0
        self._bytes_sent = self._bytes_received = 0

    @property
    def address(self) -> str:
        """The in-process name of the bound end."""
        return f"inproc://{self._name}"

    def _target(self, peer: PeerId) -> "InProcTransport":
        if self.closed:
            raise anyio.ClosedResourceError
        target = self._server if self._server is not None else self._peers.get(peer)
        if target is None or target.closed:
            raise PeerUnreachableError(f"{self.address}: peer {peer!r} is not connected")
        return target

    async def send(self, peer: PeerId, frame: bytes) -> None:
        """See :meth:`Transport.send`."""
        target = self._target(peer)
        try:
            await target._inbox_send.send((self._peer, frame))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise PeerUnreachableError(f"{self.address}: peer {peer!r} went away") from None
        self._frames_sent += 1
        self._bytes_sent += len(frame)

    def send_nowait(self, peer: PeerId, frame: bytes) -> None:
        """See :meth:`Transport.send_nowait`."""
        target = self._target(peer)
        try:
            target._inbox_send.send_nowait((self._peer, frame))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise PeerUnreachableError(f"{self.address}: peer {peer!r} went away") from None
        self._frames_sent += 1
        self._bytes_sent += len(frame)

    async def receive_batch(self, max_frames: int) -> list[tuple[PeerId, bytes]]:
        """See :meth:`Transport.receive_batch`."""
        if self.closed:
            raise anyio.ClosedResourceError
        try:
            batch = [await self._inbox.receive()]
            while len(batch) < max_frames:
                batch.append(self._inbox.receive_nowait())
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:  # only our own close ends the inbox
            raise anyio.ClosedResourceError from None
        self._frames_received += len(batch)
        self._bytes_received += sum(len(f) for _, f in batch)
        return batch

    async def aclose(self) -> None:
        """See :meth:`Transport.aclose`."""
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server._peers.pop(self._peer, None)
        self._inbox_send.close()
        self._inbox.close()
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> TransportStatistics:
        """See :meth:`Transport.statistics`."""
        return TransportStatistics(
            frames_sent=self._frames_sent,
            frames_received=self._frames_received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            frames_rejected=0,
        )
