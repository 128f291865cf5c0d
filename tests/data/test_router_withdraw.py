"""The data router's withdraw (a partial rollout's end) with real worker links: items
waiting leave at once, running ones come back aborted with their partial output, and
taken again they resume and count every token they generated. Every event goes
through a real hypergraph, which rejects an inconsistent one."""

import anyio

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import ItemResult, PeerLostError, WorkerLink, wire

from .helpers import PROMPTS, Net, cluster, item, wait_until


async def hold(link: WorkerLink, *, num_tokens: int, status: str = "aborted") -> None:
    """Hold every item until the controller asks for it back, then hand it back with
    ``num_tokens`` more tokens (an ``x`` byte each) and ``status``."""
    held: list[wire.Item] = []
    try:
        while True:
            held += link.receive_nowait()
            for it in [h for h in held if link.abort_requested(h.id)]:
                held.remove(it)
                link.complete(
                    ItemResult(
                        item=it.id,
                        status=status,
                        payload=it.payload + b"x" * num_tokens,
                        num_tokens=num_tokens,
                    )
                )
            await anyio.sleep(0.005)
    except PeerLostError:
        pass


async def finish(link: WorkerLink) -> None:
    """Complete every item at once, one more token each."""
    try:
        while True:
            for it in await link.receive():
                link.complete(ItemResult(item=it.id, payload=it.payload + b"!", num_tokens=1))
    except PeerLostError:
        pass


async def test_waiting_items_leave_at_once_and_running_ones_come_back_with_their_output(
    net: Net,
) -> None:
    async with cluster(net, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", capacity=2, serve=lambda link: hold(link, num_tokens=3))
        await c.router.wait_for_instances(1)
        items = [item(k) for k in range(5)]
        await c.router.submit(items)
        await c.picked_up("w0", 2)
        assert c.router.statistics().num_queued == 3
        taken = c.router.withdraw([i.id for i in items])
        # Three were queued: they leave now, as submitted.
        assert len(taken) == 3 and all(it.payload == f"p{it.id[1:]}".encode() for it in taken)
        back = await c.collect(2)
        assert {d.result.status for d in back} == {"aborted"}
        assert {d.item.id for d in back} | {it.id for it in taken} == {i.id for i in items}
        assert all(d.result.payload == d.item.payload + b"xxx" for d in back)
        assert c.router.statistics().num_pending == 0
        # The next iteration takes them again: the aborted ones resume from their output.
        c.add_worker("w1", serve=finish)
        await c.router.wait_for_instances(2)
        await c.router.drain(InstanceId("w0"))
        again = [
            wire.Item(
                id=d.item.id,
                group=d.item.group,
                edge=PROMPTS,
                payload=d.result.payload,
                generated=d.result.num_tokens,  # its partial output's tokens
            )
            for d in back
        ] + taken
        await c.router.submit(again)
        done = await c.collect(5)
    assert {d.instance for d in done} == {"w1"}
    by_id = {d.item.id: d.result.payload for d in done}
    for d in back:
        assert by_id[d.item.id] == d.result.payload + b"!"  # no token lost or repeated
    withdrawn = [i for e in c.graph.of(ev.ItemsWithdrawn) for i in e.items]
    assert sorted(withdrawn) == sorted(i.id for i in items)
    completed = {e.item: e.num_tokens for e in c.graph.of(ev.ItemCompleted)}
    assert completed == {i.id: (4 if i.id in {d.item.id for d in back} else 1) for i in items}
    c.graph.check()


async def test_an_item_that_finishes_before_its_abort_lands_completes(inproc: Net) -> None:
    async with cluster(inproc, [], all_instances=["w0"]) as c:
        c.add_worker("w0", serve=lambda link: hold(link, num_tokens=2, status="done"))
        await c.router.wait_for_instances(1)
        await c.router.submit([item(0)])
        await c.picked_up("w0", 1)
        assert c.router.withdraw([ItemId("i0")]) == []
        [done] = await c.collect(1)
    assert (done.result.status, done.result.payload) == ("done", b"p0xx")
    assert not c.graph.of(ev.ItemsWithdrawn) and len(c.graph.of(ev.ItemCompleted)) == 1
    c.graph.check()


async def test_a_withdrawn_item_whose_worker_fails_comes_back_as_it_was_sent(
    inproc: Net,
) -> None:
    async def deaf(link: WorkerLink) -> None:  # takes items and never answers
        try:
            while True:
                await link.receive()
        except PeerLostError:
            pass

    async with cluster(inproc, [], all_instances=["w0", "w1"]) as c:
        c.add_worker("w0", serve=deaf)
        await c.router.wait_for_instances(1)
        await c.router.submit([item(0), item(1)])
        await wait_until(lambda: "w0" in c.links and c.links["w0"].statistics().num_held == 2)
        assert c.router.withdraw([ItemId("i0"), ItemId("i1")]) == []
        c.router.fail(InstanceId("w0"), "its process ended")
        back = await c.collect(2)
        assert c.router.statistics().num_pending == 0
    assert {(d.item.id, d.result.status, d.result.payload) for d in back} == {
        ("i0", "aborted", b"p0"),
        ("i1", "aborted", b"p1"),
    }
    assert not c.graph.of(ev.ItemRouted)[2:]  # routed nowhere else
    c.graph.check()


async def test_an_item_whose_result_is_on_its_way_is_left_alone(inproc: Net) -> None:
    """The consumer reads results at its own pace: it may withdraw an item whose
    result the router has already delivered, or has not read yet."""
    async with cluster(inproc, ["w0"]) as c:
        await c.router.submit([item(0)])
        await wait_until(lambda: c.router.statistics().num_completed == 1)
        assert c.router.withdraw([ItemId("i0")]) == []
        [done] = await c.collect(1)
    assert done.result.status == "done" and not c.graph.of(ev.ItemsWithdrawn)
    c.graph.check()
