"""The simulator routes rollout requests with the data plane's own placement: the
decisions are the ones :class:`~dynarl.data.placement.Placement` makes for the same
loads, requests spread over every engine by load, and an engine with room takes the
requests waiting at others."""

import asyncio
from collections import Counter

from small_cluster import SIXTEEN_DEVICES

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.clock import ManualClock
from dynarl.core.ids import InstanceId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.data import wire
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import FifoOrder
from dynarl.data.request_queue import RequestQueue
from dynarl.data.routing import AffinityRouting
from dynarl.data.transport import PeerId
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.run import simulate


def small(slots: int = 32) -> SimulatedRun:
    """16 devices (actor 4, rollout 10 engines of ``slots`` slots, inference 2), one
    iteration of 256 sequences, static stages (no migration moves a request)."""
    return simulated_run(
        DynaRLConfig(),
        [
            *SIXTEEN_DEVICES,
            f"rollout.max_running_requests={slots}",
            "rollout.max_new_tokens=8192",
            "algorithm.num_prompts=32",
            "algorithm.group_size=8",
            "algorithm.n_minibatches=4",
            "run.num_iterations=1",
            "scheduler.mode=static-disaggregated",
        ],
    )


def _events(cfg: SimulatedRun) -> list[ev.Event]:
    seen: list[ev.Event] = []
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(simulate(cfg, on_event=seen.append))
    return seen


def _admission(events: list[ev.Event]) -> tuple[ev.ItemsEnqueued, list[ev.ItemRouted]]:
    """The first iteration's batch and the routing that follows it at once."""
    i = next(
        i for i, e in enumerate(events) if isinstance(e, ev.ItemsEnqueued) and e.edge == PROMPTS
    )
    batch = events[i]
    assert isinstance(batch, ev.ItemsEnqueued)
    routed = []
    for e in events[i + 1 :]:
        if not isinstance(e, ev.ItemRouted):
            break
        routed.append(e)
    return batch, routed


async def _placed_by_placement(
    batch: ev.ItemsEnqueued, engines: list[InstanceId], *, capacity: int, seed: int
) -> list[ev.ItemRouted]:
    """What a fresh data-plane placement routes ``batch`` to, over idle ``engines``."""
    out: list[ev.Event] = []
    placement = Placement({PROMPTS: (ROLLOUT,)}, policy=AffinityRouting(seed=seed), emit=out.append)
    cfg, clock = RouterConfig(), ManualClock()
    for iid in engines:
        queue = RequestQueue[wire.Item](
            FifoOrder(), max_size=cfg.max_queued_per_instance, clock=clock
        )
        w = WorkerState(
            PeerId(iid.encode()),
            instance=iid,
            component=ROLLOUT,
            capacity=capacity,
            queue=queue,
            now_s=0.0,
            sticky_max_queued=cfg.sticky_max_queued,
            kv_full=cfg.kv_full,
        )
        placement.add_worker(w, 0.0)
    items = [
        wire.Item(id=r.id, group=r.group, edge=PROMPTS, affinity="prefer", tokens=r.tokens)
        for r in batch.items
    ]
    placement.admit(items, 0.0)
    return [e for e in out if isinstance(e, ev.ItemRouted)]


def test_the_simulator_routes_a_batch_as_the_data_planes_placement_does() -> None:
    """Every request of the batch is routed on arrival, each to the engine a fresh
    ``Placement`` with the run's seed picks for the same idle engines."""
    cfg = small()
    batch, routed = _admission(_events(cfg))
    assert len(routed) == len(batch.items) == 256
    engines = sorted({e.instance for e in routed}, key=lambda i: int(i.rsplit("-", 1)[1]))
    assert len(engines) == 10  # 10 rollout devices, tp 1
    expected = asyncio.run(
        _placed_by_placement(
            batch,
            engines,
            capacity=cfg.job.rollout.max_running_requests,
            seed=cfg.job.run.seed,
        )
    )
    assert [(e.item, e.instance) for e in routed] == [(e.item, e.instance) for e in expected]


def test_requests_spread_over_the_engines_by_load_not_one_engine_after_another() -> None:
    """256 requests on 10 engines of 32 slots: each engine gets about a tenth (the
    simulator's own router used to fill 8 engines and leave 2 idle)."""
    cfg = small()
    _, routed = _admission(_events(cfg))
    per_engine = Counter(e.instance for e in routed)
    assert len(per_engine) == 10
    assert max(per_engine.values()) <= 0.15 * 256  # power of two choices: near even
    assert min(per_engine.values()) >= 0.05 * 256


def test_an_engine_with_room_takes_requests_waiting_at_another() -> None:
    """256 requests on 10 engines of 16 slots: engines whose own queue ran dry take
    the oldest requests waiting at the engine with the most waiting; each such move is
    a single-item requeue and a routing of that item, outside any migration."""
    cfg = small(slots=16)
    events = _events(cfg)
    stolen = [e for e in events if isinstance(e, ev.ItemsRequeued) and e.edge == PROMPTS]
    assert not any(isinstance(e, ev.MigrationStarted) for e in events)
    assert stolen and all(len(e.items) == 1 for e in stolen)
    routed = Counter(e.item for e in events if isinstance(e, ev.ItemRouted) and e.edge == PROMPTS)
    # Each request is routed once, and once more each time it moves.
    assert sum(routed.values()) == 256 + len(stolen)
    completed = [e for e in events if isinstance(e, ev.ItemCompleted) and e.edge == PROMPTS]
    assert len(completed) == 256


def test_rollout_balance_is_honoured_an_engine_below_its_share_takes_running_requests() -> None:
    """``rollout.balance``: with ``below_share`` (the default) engines that finish their
    short requests take their share of the long ones still running elsewhere (each
    requeued once, with its partial output); with ``none`` a request stays on the
    engine it was routed to; ``on_join`` moves none here (every engine is there from
    the start, so it runs as ``none`` does). (Whether the moves pay is the benchmark's
    question: here, with a short tail, the re-prefills cost 0.02 s.)"""
    ends, moved = {}, {}
    for balance in ("below_share", "on_join", "none"):
        events = _events(simulated_run(small(), [f"rollout.balance={balance}"]))
        moved[balance] = sum(
            len(e.items) for e in events if isinstance(e, ev.ItemsRequeued) and e.edge == PROMPTS
        )
        ends[balance] = max(
            e.time_s for e in events if isinstance(e, ev.ItemCompleted) and e.edge == PROMPTS
        )
    assert moved["none"] == moved["on_join"] == 0 < moved["below_share"] <= 256
    assert ends["none"] == ends["on_join"] != ends["below_share"]
