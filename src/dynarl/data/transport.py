"""The transport interface: addressed byte frames between the controller and workers.

A transport is one end of a message pipe. The controller's end reaches many workers,
each by a :data:`PeerId`; a worker's end reaches only the controller (peer
:data:`CONTROLLER`). Frames are opaque bytes (see :mod:`dynarl.data.codec`); ordering
is kept per peer. Sends are bounded: ``send`` waits while the peer's buffer is full and
``send_nowait`` raises ``anyio.WouldBlock``, so a slow consumer slows its producers.

Two implementations pass the same contract tests: ZeroMQ
(:mod:`dynarl.data.zmq_transport`) and in-process (:mod:`dynarl.data.inproc`).
"""

from typing import Final, NewType, Protocol

import msgspec

PeerId = NewType("PeerId", bytes)
"""Opaque address of the other end of a frame (a ZeroMQ routing id)."""

CONTROLLER: Final = PeerId(b"")
"""The only peer a worker's transport has."""


class TransportStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Traffic through one transport.

    ``frames_rejected`` counts messages dropped before decoding because their framing
    was wrong (a ZeroMQ message with more than one payload part).
    """

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    frames_rejected: int


class Transport(Protocol):
    """One end of an addressed, bounded, ordered frame pipe."""

    @property
    def address(self) -> str:
        """Where this end is bound or connected (a ZeroMQ endpoint, an in-process
        name); for a bound ZeroMQ end with a wildcard port, the actual port."""
        ...

    async def send(self, peer: PeerId, frame: bytes) -> None:
        """Send ``frame`` to ``peer``, waiting while its buffer is full.

        Raises :class:`~dynarl.data.errors.PeerUnreachableError` if the peer is
        unknown, ``anyio.ClosedResourceError`` if this end is closed.
        """
        ...

    def send_nowait(self, peer: PeerId, frame: bytes) -> None:
        """Send ``frame`` now or raise ``anyio.WouldBlock`` (buffer full); otherwise as
        :meth:`send`."""
        ...

    async def receive_batch(self, max_frames: int) -> list[tuple[PeerId, bytes]]:
        """Wait for at least one frame and return up to ``max_frames`` frames already
        waiting, each with its sender, in arrival order.

        Raises ``anyio.ClosedResourceError`` once this end is closed.
        """
        ...

    async def aclose(self) -> None:
        """Close this end; pending frames are dropped. Idempotent."""
        ...

    def statistics(self) -> TransportStatistics:
        """Traffic so far."""
        ...
