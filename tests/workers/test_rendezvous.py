"""A group's store is bound before its port is handed out: the host opens it on a port
the operating system picks, so no other process can take that port in between."""

import errno
import socket

import pytest

from dynarl.workers.torch.rendezvous import connect_store, open_store


def test_an_opened_store_holds_its_port_and_others_reach_it() -> None:
    store = open_store("127.0.0.1", world_size=2, timeout_s=10)
    assert 0 < store.port < 65536
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
    client = connect_store("127.0.0.1", store.port, world_size=2, timeout_s=10)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"


def test_two_stores_opened_at_once_get_different_ports() -> None:
    first = open_store("127.0.0.1", world_size=2, timeout_s=10)
    second = open_store("127.0.0.1", world_size=2, timeout_s=10)
    assert first.port != second.port
