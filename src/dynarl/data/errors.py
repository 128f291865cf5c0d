"""Errors the data plane raises: protocol, transport and routing failures.

All derive from :class:`dynarl.core.errors.DynaRLError`. Queues follow anyio's stream
conventions instead (``anyio.WouldBlock``, ``anyio.EndOfStream``,
``anyio.ClosedResourceError``), so that they read like memory object streams.
"""

from dynarl.core.errors import DynaRLError


class DataPlaneError(DynaRLError):
    """Root of the data plane's errors."""


class ProtocolError(DataPlaneError):
    """A peer broke the wire protocol (a message out of order, an item it does not
    hold); the message names the peer and what it did."""


class ProtocolVersionError(ProtocolError):
    """The controller refused this worker at hello: they speak different protocol
    versions. Install the same dynarl version on both sides."""


class HelloRefusedError(ProtocolError):
    """The controller refused this worker at hello for another reason (its instance id
    is already connected, ...); the message carries the controller's reason."""


class UnauthorizedError(HelloRefusedError):
    """The controller refused this worker at hello: it presented a wrong or missing
    run token. Start workers with the endpoint the controller gives out (it carries
    the run's token)."""


class PeerLostError(DataPlaneError):
    """The other side stopped answering, retired this worker, or declared it failed.

    Attributes:
        reconnect: the controller retired the worker to have it connect again as
            another instance (a role switch), not to stop it.
    """

    def __init__(self, message: str, *, reconnect: bool = False) -> None:
        super().__init__(message)
        self.reconnect = reconnect


class PeerUnreachableError(DataPlaneError):
    """A frame was addressed to a peer the transport does not know (it disconnected,
    or never connected)."""


class RoutingError(DataPlaneError):
    """An item cannot be routed: its edge has no consumer, its id is already pending, or
    it must return to an instance that does not exist."""
