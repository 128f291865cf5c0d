"""torch.distributed stores for a group's rendezvous: the host opens its store on a
port the operating system picks and only then tells the others, who connect to it.

Choosing a free port first and binding it later (the usual ``MASTER_PORT`` recipe)
races every other process on the machine for that port: under load another socket
takes it in between, the host fails with ``EADDRINUSE`` and the other ranks wait out
their timeout on whatever listens there now.
"""

import datetime

from torch._C._distributed_c10d import TCPStore

__all__ = ["TCPStore", "connect_store", "open_store"]


def open_store(host: str, world_size: int, timeout_s: float) -> TCPStore:
    """A store hosted by this process for a group of ``world_size``, listening on a
    free port (``.port``); it does not wait for the others to connect."""
    return TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
    """A connection to the store at ``host:port`` (blocks until it answers, at most
    ``timeout_s``)."""
    return TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
