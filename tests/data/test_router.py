"""The data router with real worker links: routing, affinity, drain, failure, bad
input and backpressure. Every event goes through a real hypergraph, which rejects an
inconsistent one."""

import contextlib
import functools
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import msgspec
import pytest

from dynarl.control import events as ev
from dynarl.core.ids import EdgeId, InstanceId, ItemId
from dynarl.data import (
    CONTROLLER,
    HelloRefusedError,
    ItemResult,
    PeerLostError,
    ProtocolVersionError,
    RouterConfig,
    RoutingError,
    WorkerLink,
    open_worker_link,
    wire,
)
from dynarl.data.codec import Rejections, worker_codec
from dynarl.data.request_order import ToolCallPriorityOrder

from .helpers import PROMPTS, ROLLOUT, Net, cluster, echo, item, wait_until

# Fast heartbeats; a liveness timeout long enough that a healthy peer never looks
# silent when the whole suite's event loop stalls for a moment (0.4 s did, in CI).
FAST = RouterConfig(heartbeat_interval_s=0.05, liveness_timeout_s=2.0)


def _encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


async def hold_until_aborted(
    link: WorkerLink, *, num_tokens: int = 0, taken: set[str] | None = None
) -> None:
    """Hold every item until the controller asks for it back, then hand it back with
    its partial output: ``num_tokens`` generated tokens (an ``x`` byte each). The ids
    of the items it received go into ``taken``."""
    held: list[wire.Item] = []
    try:
        while True:
            received = link.receive_nowait()
            held += received
            if taken is not None:
                taken.update(it.id for it in received)
            for it in [h for h in held if link.abort_requested(h.id)]:
                held.remove(it)
                link.complete(
                    ItemResult(
                        item=it.id,
                        status="aborted",
                        payload=b"partial:" + it.payload + b"x" * num_tokens,
                        num_tokens=num_tokens,
                    )
                )
            await anyio.sleep(0.005)
    except PeerLostError:
        pass


async def test_every_item_completes_exactly_once_on_every_transport(net: Net) -> None:
    async with cluster(net, ["w0", "w1", "w2"]) as c:
        items = [item(k) for k in range(300)]
        for k in range(0, 300, 50):
            await c.router.submit(items[k : k + 50])
        done = await c.collect(300)
        stats = c.router.statistics()
    assert sorted(d.item.id for d in done) == sorted(i.id for i in items)
    for d in done:
        assert d.result.payload == d.item.payload + b"@" + d.instance.encode()
    assert Counter(d.instance for d in done).keys() == {"w0", "w1", "w2"}
    c.graph.check()
    assert c.graph.graph.edges[PROMPTS].num_completed == 300
    # Each item is routed once, and once more if an idle worker took it from a queue.
    assert len(c.graph.of(ev.ItemRouted)) == 300 + stats.num_requeued
    assert (stats.num_completed, stats.num_pending, stats.rejected) == (300, 0, {})


async def test_submit_rejects_bad_batches_whole(inproc: Net) -> None:
    async with cluster(inproc, ["w0"]) as c:
        with pytest.raises(RoutingError, match="no component consumes"):
            await c.router.submit(
                [item(1), msgspec.structs.replace(item(2), edge=EdgeId("nowhere"))]
            )
        with pytest.raises(RoutingError, match="already pending"):
            await c.router.submit([item(3), item(3)])
        assert c.graph.events == []
        await c.router.submit([item(3)])
        with pytest.raises(RoutingError, match="already pending"):
            c.router.submit_nowait([item(3)])
        await c.collect(1)


async def test_a_worker_of_another_protocol_version_is_refused_in_words(net: Net) -> None:
    async with cluster(net, ["w0"]) as c:
        raw = net.connect(c.server)
        codec = worker_codec(Rejections("test"))
        for hello in (
            wire.Hello(wire.PROTOCOL_VERSION + 1, InstanceId("x"), ROLLOUT, 1),
            ["Hello", 7, {"a future": "layout"}],
        ):
            await raw.send(CONTROLLER, msgspec.msgpack.encode(hello))
            with anyio.fail_after(5):
                [(_, frame)] = await raw.receive_batch(1)
            refused = codec.decode(frame)
            assert isinstance(refused, wire.Refused) and refused.code == "version"
            assert f"version {wire.PROTOCOL_VERSION}" in refused.reason
        assert c.router.instances == ["w0"]


async def test_open_worker_link_raises_on_a_version_refusal(inproc: Net) -> None:
    server = inproc.bind()
    worker = inproc.connect(server)

    async def controller() -> None:
        [(peer, _)] = await server.receive_batch(1)
        await server.send(peer, _encode(wire.Refused("version", "speak version 9")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(controller)
        with pytest.raises(ProtocolVersionError, match="speak version 9"):
            async with open_worker_link(
                worker, instance=InstanceId("w"), component=ROLLOUT, capacity=1
            ):
                pass


async def test_a_duplicate_instance_is_refused(inproc: Net) -> None:
    async with cluster(inproc, ["w0"]) as c:
        with pytest.raises(HelloRefusedError, match="already connected"):
            async with open_worker_link(
                inproc.connect(c.server), instance=InstanceId("w0"), component=ROLLOUT, capacity=1
            ):
                pass


async def test_a_worker_says_how_many_of_the_items_it_takes_it_runs(inproc: Net) -> None:
    """A rollout slot takes more than its engine runs (the rest waits in the engine's
    queue) and says so at hello; the router fills its capacity and counts its slots as
    its room. Slots below 0 are refused."""
    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        transport = inproc.connect(c.server)
        async with open_worker_link(
            transport, instance=InstanceId("w0"), component=ROLLOUT, capacity=8, slots=2
        ) as link:
            await c.router.wait_for_instances(1)
            w = c.router._placement.workers[InstanceId("w0")]
            assert (w.capacity, w.slots) == (8, 2)
            await c.router.submit([item(k) for k in range(6)])
            await wait_until(lambda: link.statistics().num_held == 6)  # all sent to it
            assert w.num_waiting == 4 and not w.can_start_now
        with pytest.raises(HelloRefusedError, match="slots >= 0"):
            async with open_worker_link(
                inproc.connect(c.server),
                instance=InstanceId("w1"),
                component=ROLLOUT,
                capacity=4,
                slots=-1,
            ):
                pass


async def test_no_controller_means_peer_lost(inproc: Net) -> None:
    server = inproc.bind()
    with pytest.raises(PeerLostError, match="no answer to hello"):
        async with open_worker_link(
            inproc.connect(server),
            instance=InstanceId("w"),
            component=ROLLOUT,
            capacity=1,
            hello_timeout_s=0.2,
        ):
            pass


async def test_a_silent_worker_fails_and_its_items_are_served_elsewhere(net: Net) -> None:
    async with cluster(net, ["w1"], all_instances=["w0", "w1"], config=FAST) as c:
        silent = net.connect(c.server)
        await silent.send(
            CONTROLLER, _encode(wire.Hello(wire.PROTOCOL_VERSION, InstanceId("w0"), ROLLOUT, 8))
        )
        with anyio.fail_after(5):
            await c.router.wait_for_instances(2)
        await c.router.submit([item(k) for k in range(40)])
        done = await c.collect(40)
    failed = c.graph.of(ev.WorkerFailed)
    assert [(f.instance, "silent" in f.reason) for f in failed] == [("w0", True)]
    routed_to_w0 = {e.item for e in c.graph.of(ev.ItemRouted) if e.instance == "w0"}
    assert routed_to_w0, "the silent worker held nothing: the test proves nothing"
    assert sorted(d.item.id for d in done) == sorted(f"i{k}" for k in range(40))
    assert {d.instance for d in done} == {"w1"}
    c.graph.check()


async def test_bad_input_is_counted_and_harms_nothing(net: Net) -> None:
    config = RouterConfig(max_frame_bytes=4096)
    async with cluster(net, ["w0", "w1"], all_instances=["w0", "w1", "w2"], config=config) as c:
        stranger = net.connect(c.server)
        good = _encode(wire.Done(ItemResult(item=ItemId("i1"))))
        bad = [
            b"\xc1\xc1",
            good[:-2],
            b"x" * 5000,
            _encode(["Launch", 1]),
            _encode(["Done", "not a result"]),
        ]
        for frame in bad:
            await stranger.send(CONTROLLER, frame)
        await stranger.send(CONTROLLER, good)  # valid, from a peer that never said hello
        # A connected worker returning an item it does not hold.
        liar = net.connect(c.server)
        await liar.send(
            CONTROLLER, _encode(wire.Hello(wire.PROTOCOL_VERSION, InstanceId("w2"), ROLLOUT, 1))
        )
        with anyio.fail_after(5):
            await c.router.wait_for_instances(3)
        await liar.send(CONTROLLER, _encode(wire.Done(ItemResult(item=ItemId("ghost")))))
        await liar.send(CONTROLLER, b"\xc1")
        await liar.send(
            CONTROLLER, _encode(wire.Hello(wire.PROTOCOL_VERSION, InstanceId("w2"), ROLLOUT, 1))
        )
        # Meanwhile, real work goes through the two honest workers.
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w2"))
        await c.router.submit([item(k) for k in range(50)])
        done = await c.collect(50)
        stats = c.router.statistics()
    assert sorted(d.item.id for d in done) == sorted(f"i{k}" for k in range(50))
    assert {d.instance for d in done} <= {"w0", "w1"}
    assert stats.rejected == {
        "malformed": 2,
        "truncated": 1,
        "oversized": 1,
        "unknown_type": 1,
        "invalid": 1,
        "unexpected": 2,
        "stale": 1,
    }
    c.graph.check()


async def test_sessions_stick_to_the_engine_holding_their_prefix(inproc: Net) -> None:
    def three_turns(it: wire.Item) -> str:
        return "tool_call" if it.tool_calls < 2 else "done"

    async def serve(link: WorkerLink) -> None:
        await echo(link, status=three_turns)

    async with cluster(inproc, [], all_instances=["w0", "w1", "w2"]) as c:
        for name in ("w0", "w1", "w2"):
            c.add_worker(name, serve=serve)
        await c.router.wait_for_instances(3)
        sessions = [item(k, affinity="prefer") for k in range(30)]
        await c.router.submit(sessions)
        served: dict[str, list[str]] = {}
        finished = 0
        while finished < 30:
            for d in await c.collect(1):
                served.setdefault(d.item.id, []).append(d.instance)
                if d.result.status == "tool_call":
                    await c.router.resume(d.item.id, d.result.payload + b"+tool")
                else:
                    finished += 1
                    assert d.item.payload.count(b"+tool") == 2
    assert all(len(turns) == 3 and len(set(turns)) == 1 for turns in served.values())
    assert len(c.graph.of(ev.ToolCallStarted)) == len(c.graph.of(ev.ToolCallFinished)) == 60
    c.graph.check()


async def test_an_idle_worker_takes_the_oldest_item_waiting_at_a_busy_one(inproc: Net) -> None:
    """Sessions that prefer a slow worker queue there while a fast one is busy; once
    the fast one has nothing, it takes the items waiting at the slow one, oldest first,
    each routed (and reported) once more and completed once."""

    async def slow(link: WorkerLink) -> None:
        await echo(link, delay_s=0.3)

    async def fast(link: WorkerLink) -> None:
        await echo(link, delay_s=0.01)

    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", capacity=1, serve=slow)
        c.add_worker("w1", capacity=1, serve=fast)
        await c.router.wait_for_instances(2)
        sessions = [item(k, affinity="prefer", instance=InstanceId("w0")) for k in range(6)]
        await c.router.submit(sessions)
        done = await c.collect(6)
        stats = c.router.statistics()
    by_worker = Counter(d.instance for d in done)
    assert sorted(d.item.id for d in done) == sorted(i.id for i in sessions)
    assert stats.num_stolen >= 2 and by_worker["w1"] >= 3
    assert len(c.graph.of(ev.ItemRouted)) == 6 + stats.num_requeued
    stolen = [e.items[0] for e in c.graph.of(ev.ItemsRequeued)]
    assert stolen == sorted(stolen, key=lambda i: int(i[1:]))  # oldest first
    c.graph.check()


async def test_an_environment_ends_a_session_out_on_a_tool_call(inproc: Net) -> None:
    ended: list[str] = []
    all_ended = anyio.Event()

    async def hear_ends(link: WorkerLink) -> None:
        with contextlib.suppress(PeerLostError):
            while True:
                ended.extend(await link.receive_ended_sessions())
                if len(ended) == 4:
                    all_ended.set()

    async def serve(link: WorkerLink) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hear_ends, link)
            await echo(link, status=lambda it: "tool_call")
            tg.cancel_scope.cancel()

    async with cluster(inproc, [], all_instances=["w0"]) as c:
        c.add_worker("w0", serve=serve)
        await c.router.wait_for_instances(1)
        await c.router.submit([item(k, affinity="prefer") for k in range(4)])
        turns = await c.collect(4)
        for d in turns[:2]:
            await c.router.resume(d.item.id, d.result.payload + b"+tool")
        for d in turns[2:]:
            c.router.finish(d.item.id)
        with pytest.raises(RoutingError):
            c.router.finish(turns[2].item.id)  # already over
        for d in await c.collect(2):
            c.router.finish(d.item.id)
        assert c.router.statistics().num_pending == 0
        with anyio.fail_after(5):  # the worker hears each session end once
            await all_ended.wait()
        assert sorted(ended) == sorted(d.item.id for d in turns)
    completed = c.graph.of(ev.ItemCompleted)
    assert len(completed) == 4 and {e.instance for e in completed} == {"w0"}
    c.graph.check()


async def test_a_refused_item_finishes_with_its_reason_and_is_counted(inproc: Net) -> None:
    async def serve(link: WorkerLink) -> None:
        try:
            while True:
                for it in await link.receive():
                    bad = it.payload.startswith(b"bad")
                    link.complete(
                        ItemResult(
                            item=it.id,
                            status="refused" if bad else "done",
                            payload=b"prompt too long" if bad else it.payload,
                        )
                    )
        except PeerLostError:
            pass

    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", serve=serve)
        c.add_worker("w1", serve=serve)
        await c.router.wait_for_instances(2)
        items = [item(k) for k in range(6)]
        items[2] = msgspec.structs.replace(items[2], payload=b"bad")
        await c.router.submit(items)
        done = {d.item.id: d for d in await c.collect(6)}
        stats = c.router.statistics()
    assert done[ItemId("i2")].refusal == "prompt too long"
    assert [k for k, d in done.items() if d.refusal is not None] == [ItemId("i2")]
    assert stats.num_refused == 1 and stats.num_pending == 0 and stats.num_requeued == 0
    assert len(c.graph.of(ev.ItemCompleted)) == 6  # a refused item is finished, not retried
    c.graph.check()


async def test_a_session_moves_when_its_engine_has_no_room(inproc: Net) -> None:
    async with cluster(
        inproc,
        ["w0", "w1"],
    ) as c:
        stats = ev.EngineStats(
            instance=InstanceId("w0"), kv_usage=0.99, num_running=1, num_queued=0
        )
        await c.router.submit([item(1, affinity="prefer", instance=InstanceId("w0"))])
        [first] = await c.collect(1)
        assert first.instance == "w0"
        await c.links["w0"].report(stats)
        await wait_until(lambda: c.graph.of(ev.EngineStats))
        await c.router.submit([item(2, affinity="prefer", instance=InstanceId("w0"))])
        [second] = await c.collect(1)
        assert second.instance == "w1"
        await c.router.submit([item(3, affinity="must", instance=InstanceId("w0"))])
        [third] = await c.collect(1)
        assert third.instance == "w0"


async def test_drain_reroutes_queued_and_in_flight_items(inproc: Net) -> None:
    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", capacity=2, serve=hold_until_aborted)
        await c.router.wait_for_instances(1)
        await c.router.submit([item(k) for k in range(6)])
        # Two items in the worker's hands (not just sent), four queued in front of it.
        await c.picked_up("w0", 2)
        assert c.router.statistics().num_queued == 4
        c.add_worker("w1")
        await c.router.wait_for_instances(2)
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w0"))
        done = await c.collect(6)
        await c.router.retire(InstanceId("w0"))
        assert c.router.instances == ["w1"]
    assert sorted(d.item.id for d in done) == sorted(f"i{k}" for k in range(6))
    assert {d.instance for d in done} == {"w1"}
    partial = [d for d in done if d.item.payload.startswith(b"partial:")]
    assert len(partial) == 2 and all(d.item.instance == "w0" for d in partial)
    requeued = [i for e in c.graph.of(ev.ItemsRequeued) for i in e.items]
    assert sorted(requeued) == sorted(f"i{k}" for k in range(6))
    c.graph.check()


@pytest.mark.parametrize("balance", [True, False])
async def test_a_joining_worker_gets_its_share_of_what_another_is_running(
    inproc: Net, balance: bool
) -> None:
    """The join race: a batch fits the first worker's capacity, so it runs all of it;
    a worker joining a moment later finds nothing waiting. With balancing the first is
    asked (``Abort``) for its most recently dispatched half, which comes back with its
    partial output and runs on the joiner."""
    config = RouterConfig(balance_on_join=balance, balance_below_share=balance)
    async with cluster(inproc, [], all_instances=["w0", "w1"], config=config) as c:
        c.add_worker("w0", capacity=8, serve=functools.partial(hold_until_aborted, num_tokens=3))
        await c.router.wait_for_instances(1)
        await c.router.submit([item(k) for k in range(8)])
        await c.picked_up("w0", 8)
        c.add_worker("w1", capacity=8)
        await c.router.wait_for_instances(2)
        if balance:
            moved = await c.collect(4)
        else:
            await wait_until(lambda: c.router.statistics().num_active == 2)
            moved = []
        stats = c.router.statistics()
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w0"))
        rest = await c.collect(8 - len(moved))
    if balance:
        assert sorted(d.item.id for d in moved) == ["i4", "i5", "i6", "i7"]
        # (then, idle again, w1 takes half of what w0 still runs)
        assert {d.instance for d in moved} == {"w1"} and stats.num_balanced >= 4
        assert all(d.item.payload.startswith(b"partial:") for d in moved)
    else:
        assert stats.num_balanced == 0 and stats.num_requeued == 0
    assert sorted(d.item.id for d in moved + rest) == sorted(f"i{k}" for k in range(8))
    c.graph.check()


async def test_requeued_items_carry_the_tokens_they_generated(inproc: Net) -> None:
    taken: dict[str, set[str]] = {"w0": set(), "w1": set()}

    def holder(name: str, num_tokens: int) -> Callable[[WorkerLink], Awaitable[None]]:
        return functools.partial(hold_until_aborted, num_tokens=num_tokens, taken=taken[name])

    async with cluster(inproc, [], all_instances=["w0", "w1", "w2"]) as c:
        c.add_worker("w0", capacity=1, serve=holder("w0", 5))
        await c.router.wait_for_instances(1)
        await c.router.submit([item(k) for k in range(3)])
        await wait_until(lambda: taken["w0"] == {"i0"})  # the worker runs i0
        # w1 joins with room and takes i1, the oldest waiting at w0; draining w0
        # takes i2 back from its queue before it ran and aborts i0, which generated
        # 5 tokens there; both queue on w1 behind i1.
        c.add_worker("w1", capacity=1, serve=holder("w1", 7))
        await c.router.wait_for_instances(2)
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w0"))
        await wait_until(lambda: taken["w1"] == {"i1"})
        # w2 joins and takes i2 (fresh) and i0 (aborted once, with its 5 tokens)
        # from w1's queue; draining w1 aborts i1 after 7 tokens; w2 finishes all three.
        c.add_worker("w2")
        await c.router.wait_for_instances(3)
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w1"))
        done = await c.collect(3)
    requeued = [(e.items, e.generated) for e in c.graph.of(ev.ItemsRequeued)]
    assert requeued == [
        (("i1",), (0,)),
        (("i2",), (0,)),
        (("i0",), (5,)),
        (("i2",), (0,)),
        (("i0",), (5,)),
        (("i1",), (7,)),
    ]
    # Each count is the length of the partial output the item was routed again with.
    assert {d.item.id: d.item.payload.count(b"x") for d in done} == {"i0": 5, "i1": 7, "i2": 0}
    # Completion counts every token of the request, as the requeues did (w2 adds one).
    completed = {e.item: e.num_tokens for e in c.graph.of(ev.ItemCompleted)}
    assert completed == {"i0": 6, "i1": 8, "i2": 1}
    c.graph.check()


async def test_a_requeued_session_counts_the_tokens_of_every_turn(inproc: Net) -> None:
    async def tool_call_then_hold(link: WorkerLink) -> None:
        # Turn 1 generates 4 tokens and calls a tool; turn 2 is aborted after 3.
        [first] = await link.receive()
        link.complete(ItemResult(item=first.id, status="tool_call", payload=b"xxxx", num_tokens=4))
        await hold_until_aborted(link, num_tokens=3)

    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", serve=tool_call_then_hold)
        await c.router.wait_for_instances(1)
        await c.router.submit([item(0, affinity="prefer")])
        [turn] = await c.collect(1)
        assert turn.result.status == "tool_call"
        await c.router.resume(turn.item.id, turn.result.payload + b"+tool")
        await c.picked_up("w0", 1)
        c.add_worker("w1")
        await c.router.wait_for_instances(2)
        with anyio.fail_after(5):
            await c.router.drain(InstanceId("w0"))
        [done] = await c.collect(1)
    assert done.instance == "w1" and done.item.payload.count(b"x") == 7
    [requeued] = c.graph.of(ev.ItemsRequeued)
    assert (requeued.items, requeued.generated) == (("i0",), (7,))
    [completed] = c.graph.of(ev.ItemCompleted)
    assert completed.num_tokens == 8
    c.graph.check()


async def test_each_engine_serves_its_queue_in_priority_order(inproc: Net) -> None:
    gate = anyio.Event()
    order: list[str] = []

    async def one_at_a_time(link: WorkerLink) -> None:
        await gate.wait()
        await echo(link)

    async with cluster(inproc, [], all_instances=["w0"], order=ToolCallPriorityOrder()) as c:
        c.add_worker("w0", capacity=1, serve=one_at_a_time)
        await c.router.wait_for_instances(1)
        await c.router.submit([item("first")])
        await wait_until(lambda: c.router.statistics().num_in_flight >= 1)
        await c.router.submit(
            [
                item("fresh"),
                item("t1", tool_calls=1),
                item("t3", tool_calls=3),
                item("t1-long", tool_calls=1, prefix_tokens=900),
            ]
        )
        gate.set()
        order = [d.item.id for d in await c.collect(5)]
    assert order == ["ifirst", "it3", "it1-long", "it1", "ifresh"]


async def test_a_slow_consumer_slows_producers_without_failing_workers(inproc: Net) -> None:
    config = RouterConfig(
        heartbeat_interval_s=0.05,
        liveness_timeout_s=0.3,
        results_buffer=8,
        max_backlog_items=16,
        max_queued_per_instance=8,
    )
    async with cluster(inproc, ["w0", "w1"], config=config) as c:
        submitted = 0
        while submitted < 5000:
            with anyio.move_on_after(0.5) as blocked:
                await c.router.submit([item(submitted)])
            if blocked.cancelled_caught:
                break
            submitted += 1
        assert 0 < submitted < 1000, "submit never pushed back"
        await anyio.sleep(0.6)  # longer than the liveness timeout, while stalled
        assert c.graph.of(ev.WorkerFailed) == []
        done = await c.collect(submitted)
        assert c.router.statistics().num_workers == 2
    assert len({d.item.id for d in done}) == submitted


async def test_ping_round_trip_and_a_worker_that_leaves(inproc: Net) -> None:
    async with cluster(inproc, ["w0", "w1"]) as c:
        rtt = await c.router.ping(InstanceId("w0"))
        assert 0 < rtt < 1
        c.scopes["w1"].cancel()  # its link says bye on the way out
        await wait_until(lambda: len(c.router.instances) == 1)
        [failed] = c.graph.of(ev.WorkerFailed)
        assert failed.instance == "w1" and "left" in failed.reason
        with pytest.raises(RoutingError, match="no connected instance"):
            await c.router.ping(InstanceId("w1"))


async def test_a_retired_worker_sees_the_end(inproc: Net) -> None:
    outcome: list[str] = []

    async def serve(link: WorkerLink) -> None:
        try:
            while True:
                await link.receive()
        except PeerLostError as e:
            outcome.append(str(e))

    async with cluster(inproc, [], all_instances=["w0"]) as c:
        c.add_worker("w0", serve=serve)
        await c.router.wait_for_instances(1)
        with pytest.raises(RoutingError, match="drain"):
            await c.router.retire(InstanceId("w0"))
        await c.router.drain(InstanceId("w0"))
        await c.router.retire(InstanceId("w0"), "scaled in")
        await wait_until(lambda: outcome)
    assert "scaled in" in outcome[0]


async def test_frames_already_on_their_way_when_a_worker_left_are_dropped_quietly(
    inproc: Net,
) -> None:
    # A pong or a result can cross the router's Retire, or follow the worker's Bye: the
    # worker knows it is gone, so these are counted, not refused or reported. A peer
    # that never said hello is still rejected.
    async with cluster(inproc, ["w0"], all_instances=["w0", "r", "b"]) as c:
        retired, leaving, stranger = (inproc.connect(c.server) for _ in range(3))
        for raw, name in ((retired, "r"), (leaving, "b")):
            hello = wire.Hello(wire.PROTOCOL_VERSION, InstanceId(name), ROLLOUT, 1)
            await raw.send(CONTROLLER, _encode(hello))
        with anyio.fail_after(5):
            await c.router.wait_for_instances(3)
        await c.router.drain(InstanceId("r"))
        await c.router.retire(InstanceId("r"), "scaled in")
        await leaving.send(CONTROLLER, _encode(wire.Bye("closing")))
        await wait_until(lambda: c.router.instances == ["w0"])
        for raw in (retired, leaving, stranger):
            await raw.send(CONTROLLER, _encode(wire.Pong(0)))
            await raw.send(CONTROLLER, _encode(wire.Done(ItemResult(item=ItemId("late")))))
        await wait_until(lambda: c.router.statistics().rejected.get("unexpected") == 2)
        stats = c.router.statistics()
    assert stats.num_late_frames == 4
    assert stats.rejected == {"unexpected": 2}
    assert [e.instance for e in c.graph.of(ev.WorkerFailed)] == ["b"]


async def test_reports_are_stamped_and_forwarded(inproc: Net) -> None:
    async with cluster(inproc, ["w0"]) as c:
        await c.links["w0"].report(ev.WorkerIdle(instance=InstanceId("w0"), time_s=-5.0))
        await wait_until(lambda: c.graph.of(ev.WorkerIdle))
    [idle] = c.graph.of(ev.WorkerIdle)
    assert idle.time_s > 0
