"""The transport contract: the in-process and ZeroMQ (tcp, ipc) transports behave the
same: addressed, ordered, bounded frames, with the same errors."""

import anyio
import pytest
import zmq

from dynarl.data import CONTROLLER, PeerUnreachableError, Transport
from dynarl.data.transport import PeerId

from .helpers import Net


async def _hello(worker: Transport, server: Transport, tag: bytes) -> PeerId:
    """Make the worker known to the server; return its peer id there."""
    await worker.send(CONTROLLER, tag)
    with anyio.fail_after(5):
        [(peer, frame)] = await server.receive_batch(1)
    assert frame == tag
    return peer


async def test_frames_flow_both_ways_in_order_per_peer(net: Net) -> None:
    server = net.bind()
    a, b = net.connect(server), net.connect(server)
    pa, pb = await _hello(a, server, b"a"), await _hello(b, server, b"b")
    assert pa != pb
    for i in range(50):
        await server.send(pa, b"to-a %d" % i)
        await server.send(pb, b"to-b %d" % i)
    for end, name in ((a, b"a"), (b, b"b")):
        got: list[bytes] = []
        with anyio.fail_after(5):
            while len(got) < 50:
                batch = await end.receive_batch(7)
                assert 1 <= len(batch) <= 7
                assert all(peer == CONTROLLER for peer, _ in batch)
                got += [f for _, f in batch]
        assert got == [b"to-%s %d" % (name, i) for i in range(50)]
    for i in range(30):
        a.send_nowait(CONTROLLER, b"%d" % i)
    got = []
    with anyio.fail_after(5):
        while len(got) < 30:
            got += await server.receive_batch(100)
    assert got == [(pa, b"%d" % i) for i in range(30)]


async def test_frames_to_an_unknown_peer_are_refused(net: Net) -> None:
    server = net.bind()
    with pytest.raises(PeerUnreachableError):
        await server.send(PeerId(b"nobody-is-here-1"), b"x")
    with pytest.raises(PeerUnreachableError):
        server.send_nowait(PeerId(b"nobody-is-here-1"), b"x")


async def test_a_slow_receiver_makes_its_sender_wait(net: Net) -> None:
    """Nothing grows without bound: a peer that does not read stops its sender after a
    bounded number of frames (high-water marks plus socket buffers)."""
    server = net.bind()
    worker = net.connect(server)
    peer = await _hello(worker, server, b"hi")
    frame = b"x" * 65536
    num_sent = 0
    while num_sent < 2000:  # 2000 x 64 KiB would be 125 MiB
        with anyio.move_on_after(0.3) as blocked:
            await server.send(peer, frame)
        if blocked.cancelled_caught:
            break
        num_sent += 1
    assert 0 < num_sent < 2000
    with pytest.raises(anyio.WouldBlock):
        server.send_nowait(peer, frame)
    # Reading makes room again.
    with anyio.fail_after(5):
        await worker.receive_batch(1000)
        got = 0
        while True:
            try:
                server.send_nowait(peer, frame)
                break
            except anyio.WouldBlock:
                # Once the reader has taken every frame, the room it made reaches the
                # sender's socket a moment later (ZeroMQ passes it as a command between
                # its I/O threads): wait for that, not for frames that will not come.
                with anyio.move_on_after(0.05):
                    got += len(await worker.receive_batch(1000))
    assert server.statistics().frames_sent == num_sent + 1


async def test_statistics_count_frames_and_bytes(net: Net) -> None:
    server = net.bind()
    worker = net.connect(server)
    peer = await _hello(worker, server, b"12345")
    await server.send(peer, b"abc")
    with anyio.fail_after(5):
        await worker.receive_batch(1)
    s, w = server.statistics(), worker.statistics()
    assert (s.frames_received, s.bytes_received, s.frames_sent, s.bytes_sent) == (1, 5, 1, 3)
    assert (w.frames_received, w.bytes_received, w.frames_sent, w.bytes_sent) == (1, 3, 1, 5)


async def test_a_closed_end_refuses_to_work(net: Net) -> None:
    server = net.bind()
    worker = net.connect(server)
    await worker.aclose()
    await worker.aclose()  # idempotent
    with pytest.raises(anyio.ClosedResourceError):
        await worker.send(CONTROLLER, b"x")
    with pytest.raises(anyio.ClosedResourceError):
        await worker.receive_batch(1)


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc"])
async def test_zmq_messages_with_extra_parts_are_dropped_and_counted(
    kind: str, short_tmp: object
) -> None:
    from pathlib import Path

    net = Net(kind, Path(str(short_tmp)))
    try:
        server = net.bind()
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        try:
            raw.send_multipart([b"part1", b"part2"])
            raw.send(b"good")
            with anyio.fail_after(5):
                [(_, frame)] = await server.receive_batch(10)
            assert frame == b"good"
            assert server.statistics().frames_rejected == 1
        finally:
            raw.close()
            ctx.term()
    finally:
        await net.aclose()
