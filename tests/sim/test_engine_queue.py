"""A modelled engine's own queue: served by rank (the request order's key), then
arrival; a retracted job in front of its rank; and the fleet hands an engine what a real
slot takes, more than its running batch."""

import asyncio

from small_cluster import SIXTEEN_DEVICES

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim import H100, EngineConfig, Job, SimEngine, model
from dynarl.sim.config import simulated_run
from dynarl.sim.engine_queue import EngineQueue
from dynarl.sim.jobs import EngineEntry
from dynarl.sim.run import simulate
from dynarl.workers.config import SLOT_CAPACITY


def _entry(name: str, rank: tuple[float, ...] = ()) -> EngineEntry:
    return EngineEntry(
        Job(id=ItemId(name), group=GroupId("g"), context_tokens=8, output_tokens=4, rank=rank)
    )


def _drain(queue: EngineQueue) -> list[str]:
    return [queue.pop().job.id for _ in range(len(queue))]


def test_fifo_serves_arrival_order_and_a_retracted_job_first() -> None:
    q = EngineQueue()
    for name in "abc":
        q.push(_entry(name))
    q.push_front(_entry("r1"))
    q.push_front(_entry("r2"))  # retracted later: it was the younger, and goes first
    assert q.peek().job.id == "r2"
    assert _drain(q) == ["r2", "r1", "a", "b", "c"]


def test_ranks_come_before_arrival_and_a_retracted_job_keeps_its_rank() -> None:
    q = EngineQueue()
    q.push(_entry("late-turn", (-2.0, 0.0, 5.0)))
    q.push(_entry("first-turn", (0.0, 0.0, 1.0)))
    q.push(_entry("second-turn", (-1.0, 0.0, 2.0)))
    q.push(_entry("first-turn-too", (0.0, 0.0, 1.0)))
    q.push_front(_entry("retracted", (0.0, 0.0, 1.0)))
    q.push_front(_entry("retracted-later", (0.0, 0.0, 4.0)))
    assert _drain(q) == [
        "late-turn",
        "second-turn",
        "retracted",
        "first-turn",
        "first-turn-too",
        "retracted-later",
    ]


def test_removed_jobs_leave_and_the_rest_keep_their_order() -> None:
    q = EngineQueue()
    for i, name in enumerate("abcde"):
        q.push(_entry(name, (float(-i % 3),)))
    taken = q.remove([ItemId("b"), ItemId("x"), ItemId("e")])
    assert sorted(e.job.id for e in taken) == ["b", "e"]
    assert ItemId("b") not in q and ItemId("a") in q
    assert q.ids == {"a", "c", "d"}
    assert _drain(q) == ["a", "d", "c"]  # ranks 0, 0, 1


def test_an_engine_with_a_full_batch_admits_its_queue_by_rank() -> None:
    engine = SimEngine(
        EngineConfig(gpu=H100, model=model("R1-Distill-Qwen-1.5B"), max_running_requests=1),
        instance=InstanceId("e0"),
    )
    jobs = [
        Job(id=ItemId(n), group=GroupId("g"), context_tokens=64, output_tokens=32, rank=r)
        for n, r in [("running", (0.0,)), ("low", (0.0,)), ("high", (-3.0,)), ("mid", (-1.0,))]
    ]
    engine.submit(jobs[:1])  # admitted at once: the engine was idle
    engine.submit(jobs[1:])  # queued behind it, each by its rank
    done: list[str] = []
    while (t := engine.next_event_time()) < float("inf"):
        done += [d.id for d in engine.advance_to(t)]
    assert done == ["running", "high", "mid", "low"]


def test_the_fleet_hands_an_engine_what_a_real_slot_takes_beyond_its_batch() -> None:
    # A real slot says it serves SLOT_CAPACITY requests, more than its engine runs at
    # once (32 here; 64 requests an engine): the engine queues the rest itself, as the
    # modelled one must.
    reports: list[ev.EngineStats] = []

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.EngineStats):
            reports.append(event)

    cfg = simulated_run(
        DynaRLConfig(),
        [
            *SIXTEEN_DEVICES,
            "scheduler.mode=static-colocated",
            "rollout.max_running_requests=32",
            "algorithm.num_prompts=128",
            "algorithm.group_size=8",
            "run.num_iterations=1",
        ],
    )
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(simulate(cfg, on_event=on_event))
    assert SLOT_CAPACITY > 32
    assert any(r.num_running == 32 and r.num_queued > 0 for r in reports)
