"""Where the controller's data router listens, as the cluster section says: a
private ``ipc://`` socket when every worker is a local process, else TCP on
``cluster.bind_host`` (or this machine's network address) and ``controller_port``,
advertising an address the workers' nodes can dial."""

from pathlib import Path
from typing import NamedTuple

from dynarl.data.endpoint import advertised_address, node_address, tcp_address
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.config import ClusterConfig


class Binding(NamedTuple):
    """The router's bound transport and the address workers dial."""

    transport: ZmqTransport
    advertised: str


def bind_controller(cluster: ClusterConfig, ipc_dir: Path) -> Binding:
    """Bind the controller's end of the data plane for ``cluster`` (the ``ipc://``
    socket goes in ``ipc_dir``). Raises :class:`~dynarl.data.errors.DataPlaneError`
    if the address cannot be bound (naming it)."""
    if not cluster.uses_tcp:
        transport = ZmqTransport.bind(f"ipc://{ipc_dir}/router.sock")
        return Binding(transport, transport.address)
    host = cluster.bind_host or node_address()
    transport = ZmqTransport.bind(tcp_address(host, cluster.controller_port or "*"))
    return Binding(transport, advertised_address(transport.address, cluster.advertise_host))
