"""The Ray launcher on a simulated two-node Ray cluster (two raylets on this machine):
workers start as actors in placement groups that keep a TP group on one node, dial
the controller over TCP with the run's token and answer; a killed actor reaches the
router as a worker failure at once and its items finish elsewhere, exactly once; the
workers' output reaches the log folder; closing leaves no process and no placement
group."""

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from dynarl.control import events as ev
from dynarl.core.ids import EdgeId, GroupId, InstanceId, ItemId
from dynarl.data import Item, Router, RouterConfig
from dynarl.data.endpoint import new_token, node_address, split_endpoint
from dynarl.launch.binding import bind_controller
from dynarl.launch.config import ClusterConfig
from dynarl.launch.ray import RayLauncher
from dynarl.launch.ray_placement import DevicePlacement
from dynarl.workers.errors import LaunchError
from dynarl.workers.slot import SlotConfig

from .ray_workers import echo_worker

pytestmark = pytest.mark.slow

PROMPTS = EdgeId("prompts")
RAY = ClusterConfig(launcher="ray", num_devices=4)


class Controller:
    def __init__(self, router: Router, log_dir: Path) -> None:
        self.router = router
        self.log_dir = log_dir
        self.failed: dict[str, str] = {}
        self.failure = anyio.Event()

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorkerFailed):
            self.failed[event.instance] = event.reason
            self.failure.set()


@asynccontextmanager
async def controller() -> AsyncIterator[Controller]:
    """A router bound as a Ray run binds it (TCP on this machine's address, a token)."""
    folder = Path(tempfile.mkdtemp(prefix="dyn-"))
    transport, advertised = bind_controller(RAY, folder)
    c: Controller | None = None

    def on_event(event: ev.Event) -> None:
        if c is not None:
            c.on_event(event)

    try:
        async with Router(
            transport,
            consumers={PROMPTS: ["rollout"]},
            config=RouterConfig(heartbeat_interval_s=0.2, liveness_timeout_s=60.0),
            token=new_token(),
            advertised_address=advertised,
            on_event=on_event,
        ) as router:
            c = Controller(router, folder / "workers")
            yield c
    finally:
        await transport.aclose()
        shutil.rmtree(folder, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (exited, not yet reaped: an orphaned
    worker whose actor was killed waits for whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def gone(pids: list[int | None], timeout_s: float = 15.0) -> list[int]:
    """The processes of ``pids`` still running after waiting up to ``timeout_s`` for
    them to exit (an orphaned worker notices its parent went within a poll)."""
    running = [p for p in pids if p is not None and alive(p)]
    for _ in range(int(timeout_s / 0.1)):  # exits are seen in /proc only: poll
        if not running:
            break
        await anyio.sleep(0.1)
        running = [p for p in running if alive(p)]
    return running


def items(n: int) -> list[Item]:
    return [
        Item(id=ItemId(f"i{k}"), group=GroupId(f"g{k}"), edge=PROMPTS, payload=b"p%d" % k)
        for k in range(n)
    ]


@pytest.mark.timeout(150)
async def test_workers_run_as_actors_a_tp_group_per_node_and_a_killed_actor_fails_over(
    ray_cluster: Any,
) -> None:
    import ray

    async with controller() as c:
        address, _ = split_endpoint(c.router.endpoint)
        assert address.startswith(f"tcp://{node_address()}:")  # not loopback, not ipc
        launcher = RayLauncher(
            c.router,
            RAY,
            slot=SlotConfig(),
            slot_devices=[],
            worker_devices={f"w-{d}": d for d in range(4)},
            group_size=2,  # devices 0-1 and 2-3 are TP groups
            log_dir=c.log_dir,
        )
        try:
            await launcher.start()
            names = [f"w-{d}" for d in range(4)]
            handles = await launcher.start_workers(echo_worker, names, num_threads=1)
            assert sorted(c.router.instances) == names
            assert await c.router.call(InstanceId("w-3"), b"hi") == b"pong:hi"

            # Each node has room for one group of two 1-CPU bundles: a group is never
            # split, so the two groups sit on the two nodes.
            where = launcher.locations
            assert where["w-0"].node == where["w-1"].node
            assert where["w-2"].node == where["w-3"].node
            assert where["w-0"].node != where["w-2"].node
            pids = [h.pid for h in handles]
            assert all(p is not None and alive(p) for p in pids)

            # Kill one actor while its items are in flight: the router hears of it from
            # the launcher and every item completes exactly once on the others.
            await c.router.submit(items(24))
            with anyio.fail_after(30):
                done = await c.router.receive_batch()  # items flow: each worker holds 4
            victim = launcher._workers[2]
            assert victim.name == "w-2"
            ray.kill(victim.actor, no_restart=True)
            with anyio.fail_after(60):
                while len(done) < 24:
                    done += await c.router.receive_batch()
            assert sorted(d.item.id for d in done) == sorted(i.id for i in items(24))
            assert {d.instance for d in done} <= {"w-0", "w-1", "w-2", "w-3"}
            # Whichever came first (here, on one machine, the closed socket), both the
            # router and the launcher's actor watch saw it.
            assert list(c.failed) == ["w-2"], c.failed
            with anyio.fail_after(10):
                await victim.exited.wait()
            assert victim.ended is not None and "lost its Ray actor" in victim.ended
            assert "w-2" not in c.router.instances
            stats = c.router.statistics()
            assert stats.num_workers_failed == 1 and stats.num_pending == 0

            # The dead worker is started again (the reboot of its device): a new actor
            # on the same device's bundle, the same entry, reachable as before.
            restarted = await launcher.restart_worker("w-2")
            assert restarted.pid is not None and restarted.pid != victim.handle.pid
            assert alive(restarted.pid)
            assert "w-2" in c.router.instances
            assert launcher.locations["w-2"].node == where["w-2"].node  # its group's node
            assert await c.router.call(InstanceId("w-2"), b"again") == b"pong:again"
            pids.append(restarted.pid)
            with pytest.raises(LaunchError, match="still runs"):
                await launcher.restart_worker("w-2")
        finally:
            await launcher.aclose()
        await launcher.aclose()  # closing twice is harmless

        assert not await gone(pids)
        # Every live worker's output reached the log folder (a killed actor's is copied
        # through that actor every 0.5 s: what it printed after the last copy is lost
        # with it, and here it may die before the first).
        for name in names:
            if name != "w-2":
                assert f"{name} serving" in (c.log_dir / f"{name}.log").read_text()
        table = ray.util.placement_group_table()
        assert all(pg["state"] == "REMOVED" for pg in table.values())


@pytest.mark.timeout(60)
async def test_a_tp_group_larger_than_any_node_is_refused_not_split(ray_cluster: Any) -> None:
    placement = DevicePlacement([0, 1, 2], group_size=3, bundle={"CPU": 1.0})
    with pytest.raises(LaunchError, match="every group on one node"):
        await placement.reserve(timeout_s=3.0)


@pytest.mark.timeout(240)
async def test_a_lost_node_fails_its_workers_and_a_new_node_takes_them_back(
    ray_cluster: Any,
) -> None:
    async with controller() as c:
        launcher = RayLauncher(
            c.router,
            RAY,
            slot=SlotConfig(),
            slot_devices=[],
            worker_devices={f"w-{d}": d for d in range(4)},
            group_size=2,
        )
        try:
            await launcher.start()
            names = [f"w-{d}" for d in range(4)]
            await launcher.start_workers(echo_worker, names, num_threads=1)
            where = launcher.locations
            head = ray_cluster.head_node.node_id
            lost = [n for n in names if where[n].node != head]
            assert len(lost) == 2  # one TP group on each node
            [node] = [n for n in ray_cluster.list_all_nodes() if n.node_id != head]

            await c.router.submit(items(24))
            with anyio.fail_after(30):
                done = await c.router.receive_batch()
            # The node crashes: its raylet and every process on it are killed (Ray's
            # test cluster does this from the main thread).
            ray_cluster.remove_node(node, allow_graceful=False)
            with anyio.fail_after(90):
                while len(done) < 24:
                    done += await c.router.receive_batch()
            assert sorted(d.item.id for d in done) == sorted(i.id for i in items(24))
            # A worker that held no item when the node went is failed by the router's
            # liveness check or the launcher's actor watch, maybe after the last item.
            with anyio.move_on_after(60):
                while sorted(c.failed) != lost:
                    c.failure = anyio.Event()
                    await c.failure.wait()
            assert sorted(c.failed) == lost, c.failed
            assert sorted(c.router.instances) == sorted(set(names) - set(lost))
            with anyio.fail_after(60):
                for w in launcher._workers:
                    if w.name in lost:
                        await w.exited.wait()
            # A new node joins (as a replaced machine would): Ray places the lost
            # bundles there, and a restarted worker runs in its device's bundle on it.
            replaced = ray_cluster.add_node(num_cpus=2, resources={"node-b": 1})
            with anyio.fail_after(90):
                handle = await launcher.restart_worker(lost[0])
            assert launcher.locations[lost[0]].node == replaced.node_id
            await c.router.submit(items(4))
            with anyio.fail_after(30):
                again = await c.router.receive_batch()
                while len(again) < 4:
                    again += await c.router.receive_batch()
            assert handle.instance in c.router.instances
        finally:
            await launcher.aclose()
            if len(ray_cluster.list_all_nodes()) < 2:  # later tests want both nodes
                ray_cluster.add_node(num_cpus=2, resources={"node-b": 1})
