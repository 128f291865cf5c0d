"""The data plane: wire messages, codec, transports (ZeroMQ, in-process), the data
router and the priority-aware request queue.

``data`` moves messages; it imports from ``core`` and ``control`` (events, request
orders), never the other way round. The ZeroMQ transport is imported on demand
(``from dynarl.data.zmq_transport import ZmqTransport``) so that this package stays
light.
"""

from dynarl.data.codec import Codec, Rejections, controller_codec, worker_codec
from dynarl.data.errors import (
    DataPlaneError,
    HelloRefusedError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    ProtocolVersionError,
    RoutingError,
    UnauthorizedError,
)
from dynarl.data.inproc import InProcNetwork, InProcTransport
from dynarl.data.peers import RouterConfig, RouterStatistics
from dynarl.data.placement import RoutedResult
from dynarl.data.request_queue import AgingBound, QueueStatistics, RequestQueue
from dynarl.data.router import Router
from dynarl.data.routing import AffinityRouting, RoutingPolicy
from dynarl.data.transport import CONTROLLER, PeerId, Transport, TransportStatistics
from dynarl.data.wire import PROTOCOL_VERSION, Affinity, Item, ItemResult, ResultStatus
from dynarl.data.worker_link import LinkStatistics, WorkerLink, open_worker_link

__all__ = [
    "CONTROLLER",
    "PROTOCOL_VERSION",
    "Affinity",
    "AffinityRouting",
    "AgingBound",
    "Codec",
    "DataPlaneError",
    "HelloRefusedError",
    "InProcNetwork",
    "InProcTransport",
    "Item",
    "ItemResult",
    "LinkStatistics",
    "PeerId",
    "PeerLostError",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "QueueStatistics",
    "Rejections",
    "RequestQueue",
    "ResultStatus",
    "RoutedResult",
    "Router",
    "RouterConfig",
    "RouterStatistics",
    "RoutingError",
    "RoutingPolicy",
    "Transport",
    "TransportStatistics",
    "UnauthorizedError",
    "WorkerLink",
    "controller_codec",
    "open_worker_link",
    "worker_codec",
]
