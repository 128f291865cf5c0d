"""Where workers reach the controller, and the run token they present there.

The controller's data router listens on a ZeroMQ address: a private ``ipc://`` socket
when every worker runs on this machine, or ``tcp://HOST:PORT`` bound on a chosen
interface when workers run on other nodes (the Ray launcher). The address it binds
(``tcp://0.0.0.0:PORT``, say) is not always one a worker can dial, so the router
advertises a reachable one (:func:`advertised_address`).

Each run has a secret token (:func:`new_token`). A worker is started with a *worker
endpoint*: the advertised address and the token in one string,
``"tcp://10.0.0.5:41234#TOKEN"`` (:func:`worker_endpoint`), which the worker splits
again (:func:`split_endpoint`) to dial the address and present the token in its hello.
A peer on the network that does not know the token is refused at hello and never joins.
"""

import ipaddress
import secrets
import socket
from typing import Final

from dynarl.data.errors import DataPlaneError

WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "*"})
"""Bind hosts that mean every interface (not an address a worker can dial)."""

_SEPARATOR: Final = "#"


def new_token() -> str:
    """A fresh run token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def worker_endpoint(address: str, token: str) -> str:
    """The string a worker is started with: ``address`` (a ZeroMQ endpoint it can
    dial) and the run's ``token`` (empty: the router asks for none)."""
    if _SEPARATOR in address:
        raise DataPlaneError(f"a controller address cannot contain {_SEPARATOR!r}: {address!r}")
    return f"{address}{_SEPARATOR}{token}" if token else address


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """The ZeroMQ address and the token of a worker endpoint (token ``""`` if it has
    none)."""
    address, _, token = endpoint.partition(_SEPARATOR)
    return address, token


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://HOST:PORT``, bracketing an IPv6 host."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def advertised_address(bound: str, host: str | None = None) -> str:
    """The address workers dial to reach a router bound at ``bound`` (the actual
    endpoint, with its port): ``bound`` itself for ``ipc://``, else ``tcp://`` with
    ``host`` (default: the bound host, or this machine's address when the router is
    bound on every interface)."""
    if not bound.startswith("tcp://"):
        if host is not None:
            raise DataPlaneError(f"cannot advertise host {host!r} for {bound!r}: not a TCP address")
        return bound
    bound_host, _, port = bound.removeprefix("tcp://").rpartition(":")
    bound_host = bound_host.strip("[]")
    if host is None:
        host = node_address() if bound_host in WILDCARD_HOSTS else bound_host
    return tcp_address(host, port)


def node_address() -> str:
    """This machine's address on the network other nodes reach it by: the source
    address of its default route (no packet is sent), else the address its host name
    resolves to, else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            # Connecting a UDP socket only picks a route and a source address.
            probe.connect(("10.254.254.254", 1))
            address: str = probe.getsockname()[0]
            if not ipaddress.ip_address(address).is_unspecified:
                return address
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
