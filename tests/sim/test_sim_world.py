"""The real controller against the simulated cluster: conservation, determinism,
sanity of the schedules, the timeline and the CLI."""

import asyncio
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.cli import main
from dynarl.control import events as ev
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.topology import ACTOR
from dynarl.core.clock import ManualClock
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.obs.timeline import Interval, TimelineRecorder, read_timeline, write_timeline
from dynarl.sim.actor import SimActor
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.metrics import WorldTotals
from dynarl.sim.run import ModeResult, simulate
from dynarl.sim.world import SimWorld


def small(devices: int = 16, *extra: str) -> SimulatedRun:
    """A 16-device cluster (actor 4, rollout 10, inference 2) with 256 sequences."""
    scale = devices // 16
    return simulated_run(
        DynaRLConfig(),
        [
            f"cluster.num_devices={devices}",
            f"actor.initial_devices={4 * scale}",
            f"rollout.initial_devices={10 * scale}",
            f"inference.initial_devices={2 * scale}",
            "actor.tp=2",
            "inference.tp=2",
            "rollout.max_running_requests=32",
            "rollout.max_new_tokens=8192",
            "algorithm.num_prompts=32",
            "algorithm.group_size=8",
            "algorithm.n_minibatches=4",
            "run.num_iterations=2",
            *extra,
        ],
    )


def run(
    cfg: SimulatedRun, *, check: bool = True, on_event: Callable[[ev.Event], None] | None = None
) -> tuple[ModeResult, TimelineRecorder]:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(simulate(cfg, check=check, on_event=on_event))


MODES = ["dynamic", "static-colocated", "static-disaggregated", "rlhfuse"]


@pytest.mark.parametrize("mode", MODES)
def test_every_requested_token_is_generated_exactly_once(mode: str) -> None:
    """Across migrations (aborted requests resume elsewhere) no token is lost or
    generated twice; the hypergraph's invariants hold after every event."""
    result, _ = run(small(16, f"scheduler.mode={mode}"))
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert result.events_rejected == {}
    assert all(r.requests == r.num_sequences for r in result.iterations)
    if mode != "static-disaggregated":
        assert result.num_migrations > 0


def test_the_engines_reports_add_up_to_the_tokens_they_generated() -> None:
    """Each report's rate times the time since the engine's last report (or its start)
    sums to what the engines generated: the controller's progress estimates rest on it.
    (Reports of engines idle since their last event once came stamped later than the
    window they measured, losing a quarter of the tokens.)"""
    migrations: dict[int, tuple[InstanceId, ...]] = {}
    last: dict[InstanceId, float] = {}
    reported = [0.0]

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.MigrationStarted):
            migrations[e.migration.id] = tuple(spec.id for spec in e.migration.create)
        elif isinstance(e, ev.MigrationDone):
            last.update(dict.fromkeys(migrations[e.migration], e.time_s))
        elif isinstance(e, ev.EngineStats):
            reported[0] += e.gen_tokens_per_s * (e.time_s - last.get(e.instance, 0.0))
            last[e.instance] = e.time_s

    result, _ = run(small(16, "scheduler.mode=dynamic"), check=False, on_event=on_event)
    assert result.num_migrations > 0
    assert reported[0] == pytest.approx(result.engine_tokens, rel=1e-3)


def test_engines_report_on_a_real_reporters_schedule() -> None:
    """Engines report as a real slot's load reporter does: all of them every
    ``sim.stats_period_s``, and between those only an engine that ran out of requests
    (its counts final for what it was given). They once reported at every request that
    started or ended, 27 times a simulated second each on agentic 1.5B, so the
    simulated controller saw engine loads fresher than a real one can."""
    by_time: dict[float, list[ev.EngineStats]] = {}
    period = 1.0

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.EngineStats):
            by_time.setdefault(e.time_s, []).append(e)

    cfg = small(16, "sim.workload=agentic", f"sim.stats_period_s={period}")
    result, _ = run(cfg, check=False, on_event=on_event)
    rounds = [t for t, reports in by_time.items() if len(reports) > 1]
    between = [r for t, reports in by_time.items() if len(reports) == 1 for r in reports]
    assert rounds and between
    assert all(r.num_running == r.num_queued == 0 for r in between)
    simulated_s = sum(r.duration_s for r in result.iterations)
    assert len(rounds) <= simulated_s / period + 2 * len(result.iterations) + 1


@pytest.mark.parametrize("order", ["fifo", "priority"])
def test_agentic_turns_and_tool_calls_are_conserved(order: str) -> None:
    cfg = small(16, "sim.workload=agentic", f"sim.request_order={order}", "run.num_iterations=1")
    result, _ = run(cfg)
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert result.events_rejected == {}
    assert result.unit == "requests/s"
    assert sum(r.tool_calls for r in result.iterations) > 256


def test_same_seed_same_result() -> None:
    cfg = small(16, "sim.workload=agentic", "sim.request_order=priority", "run.num_iterations=1")
    a, ta = run(cfg, check=False)
    b, tb = run(cfg, check=False)
    assert a.iterations == b.iterations
    assert a.throughput == b.throughput
    assert ta.intervals == tb.intervals
    c, _ = run(simulated_run(cfg, ["run.seed=1"]), check=False)
    assert c.iterations != a.iterations


def test_static_colocated_shows_the_long_tail() -> None:
    """All devices decode, and the batch dwindles long before rollout ends: averaged
    over the rollout, fewer than 40% of the requests are still running (every request
    starts at once), while rollout holds (nearly) every device to the end."""
    finished: list[float] = []

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.ItemCompleted) and event.edge == "prompts":
            finished.append(event.time_s)

    cfg = small(
        16,
        "scheduler.mode=static-colocated",
        "rollout.max_new_tokens=28672",
        "run.num_iterations=1",
    )  # the reference's cap: few responses are cut, so the tail is the lengths' own
    result, timeline = run(cfg, on_event=on_event)
    first = result.iterations[0]
    times = sorted(t for t in finished if t <= first.end_s)
    assert len(times) == 256
    start, end = first.start_s, times[-1]
    mean_running = sum(t - start for t in times) / (end - start)
    assert mean_running < 0.4 * len(times)
    held = timeline.device_seconds(start, end)
    assert held["rollout"] > 0.75 * 16 * (end - start)


@pytest.mark.parametrize("mode", ["dynamic", "static-colocated", "static-disaggregated"])
def test_more_devices_never_make_a_mode_slower(mode: str) -> None:
    slow, _ = run(small(16, f"scheduler.mode={mode}"), check=False)
    fast, _ = run(small(32, f"scheduler.mode={mode}"), check=False)
    assert fast.mean_iteration_s <= slow.mean_iteration_s * 1.02


def test_no_mode_beats_the_work_conserving_bound() -> None:
    for mode in ("dynamic", "static-colocated"):
        result, _ = run(small(16, f"scheduler.mode={mode}"), check=False)
        assert result.bound_gap > 0
        assert result.bound_s < result.mean_iteration_s
        # Only the dynamic mode scores its plans, so only its predictions are judged.
        accuracy = result.plan_accuracy
        assert (accuracy.plans > 0) == (mode == "dynamic")
        assert accuracy.p90_abs >= abs(accuracy.median)
        # Where the time above the bound went: every cause accounted, none below zero
        # by more than the bound's approximation (it prices each sample's attention
        # alone, an inference replica per batch: -0.02% of an iteration on the
        # reference rows), and the colocated rollout's thin-batch tail the largest.
        gap = result.gap_s
        assert set(gap) == {"rollout", "inference", "actor", "moving", "idle"}
        assert sum(gap.values()) == pytest.approx(result.mean_iteration_s - result.bound_s)
        assert min(gap.values()) > -1e-3 * result.mean_iteration_s
        assert gap["moving"] > 0
        if mode == "static-colocated":
            assert max(gap, key=lambda cause: gap[cause]) == "rollout"


def test_timeline_never_puts_a_device_in_two_places(tmp_path: Path) -> None:
    _result, timeline = run(small(16, "scheduler.mode=dynamic"), check=False)
    by_device: dict[int, list[Interval]] = {}
    for iv in timeline.intervals:
        by_device.setdefault(iv.device, []).append(iv)
    assert sorted(by_device) == list(range(16))
    end = timeline.intervals and max(iv.end_s for iv in timeline.intervals)
    for spans in by_device.values():
        spans.sort(key=lambda iv: iv.start_s)
        assert spans[0].start_s == 0.0 and spans[-1].end_s == end
        for a, b in itertools.pairwise(spans):
            assert a.end_s == b.start_s and a.component != b.component
    path = tmp_path / "timeline.jsonl"
    write_timeline(path, [timeline])
    lines = read_timeline(path)
    assert [x for x in lines if isinstance(x, Interval)] == sorted(
        timeline.intervals, key=lambda iv: iv.start_s
    )


def test_rlhfuse_starts_inference_on_the_rollout_tail() -> None:
    """The fusion migration (rollout engines to inference) starts while the rollout
    tail still runs, and training still waits for every sample."""
    completed = 0
    fused_at: list[int] = []
    first_step_at: list[int] = []

    def on_event(event: ev.Event) -> None:
        nonlocal completed
        if isinstance(event, ev.IterationStarted):
            completed = 0
        elif isinstance(event, ev.ItemCompleted) and event.edge == "prompts":
            completed += 1
        elif isinstance(event, ev.MigrationStarted):
            m = event.migration
            if m.src == "rollout" and m.dst == "inference" and completed < 256:
                fused_at.append(completed)
        elif isinstance(event, ev.TrainStepDone) and event.step == 0:
            first_step_at.append(completed)

    run(small(16, "scheduler.mode=rlhfuse"), check=False, on_event=on_event)
    assert len(fused_at) == 2  # once per iteration, when the tail begins
    # (52 of 256 left on one seed since the data plane routes: its queues spread
    # requests over every engine rather than filling one before the next)
    assert all(256 - n <= 0.25 * 256 for n in fused_at)
    assert first_step_at == [256, 256]


def test_cli_sim_writes_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "sim",
            "--out",
            str(tmp_path),
            "--modes",
            "dynamic,static-colocated",
            "--set",
            "rollout.max_new_tokens=2048",
            "--set",
            "run.num_iterations=2",
        ]
    )
    assert code == 0
    for name in ("config.yaml", "metrics.jsonl", "timeline.jsonl", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
    out = capsys.readouterr().out
    assert "static-colocated" in out and "bound" in out
    assert main(["plot", str(tmp_path)]) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)  # 32b: ~110 s on an idle 2-core machine, three modes
@pytest.mark.parametrize(
    ("size", "devices"), [("1.5b", 64), ("1.5b", 128), ("7b", 64), ("32b", 64)]
)
def test_dynamic_is_never_worse_than_the_better_static_mode_on_the_math_settings(
    size: str, devices: int
) -> None:
    """On the reference math settings dynamic is at least as fast as the better static
    mode, within 5%: the router spreads the rollout tail over the engines in every
    mode (an engine below its share takes its share), so at 64 devices the static
    modes lose little to the tail and there is little to reclaim. At 1.5B on 128
    devices, one wave of requests whose tail dominates, dynamic wins (1.19x)."""
    from recipes.paper import paper_setting

    results = {
        mode: run(paper_setting("math", size, devices, mode=mode, num_iterations=2), check=False)[0]
        for mode in ("dynamic", "static-colocated", "static-disaggregated")
    }
    best = max(results["static-colocated"].throughput, results["static-disaggregated"].throughput)
    assert results["dynamic"].throughput >= 0.95 * best
    if devices == 128:
        assert results["dynamic"].throughput > 1.1 * best


def test_inference_samples_are_scored_once_where_the_placement_sent_them() -> None:
    """Through the inference placement, while the scheduler drains replicas: every
    sample is scored exactly once, by the replica it was last routed to (a drained
    replica's samples are routed again first)."""
    cfg = small(
        16,
        "scheduler.mode=dynamic",
        "rollout.initial_devices=6",
        "inference.initial_devices=6",
        "inference.micro_batch_size=4",
        "run.num_iterations=1",
    )
    owner: dict[str, str | None] = {}
    scored: list[str] = []
    drained: set[str] = set()

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.ItemRouted) and event.edge == "to_inference":
            owner[event.item] = event.instance
        elif isinstance(event, ev.ItemsRequeued) and event.edge == "to_inference":
            for item in event.items:
                assert owner[item] is not None
                owner[item] = None
        elif isinstance(event, ev.ItemCompleted) and event.edge == "to_inference":
            assert owner[event.item] == event.instance
            scored.append(event.item)
        elif isinstance(event, ev.MigrationStarted) and event.migration.src == "inference":
            drained.update(event.migration.drain)

    result, _ = run(cfg, check=False, on_event=on_event)
    assert result.events_rejected == {}
    assert drained  # inference replicas were drained during the run
    assert len(scored) == len(set(scored)) == len(owner) == 256


def test_a_plan_reassigns_a_drained_replicas_samples() -> None:
    """A drained replica's samples go where the plan's ``reassign`` says (the
    placement's ``plan``), the unplanned ones where the routing policy sends them."""
    cfg = small(
        16,
        "scheduler.mode=dynamic",
        "rollout.initial_devices=6",
        "inference.initial_devices=6",
        "inference.micro_batch_size=2",
    )
    emitted: list[ev.Event] = []

    async def main() -> SimWorld:
        graph, _ = build_hypergraph(cfg.job.pipeline_layout())
        world = SimWorld(graph, emitted.append, ManualClock(), cfg)
        world.inference.sync(0.0)
        return world

    world = asyncio.run(main())
    replicas = sorted(world.inference.workers)
    assert len(replicas) == 3
    samples = [ev.ItemRef(ItemId(f"s{k}"), GroupId("g")) for k in range(30)]
    world.inference.admit(samples, 0.0)
    first = {e.item: e.instance for e in emitted if isinstance(e, ev.ItemRouted)}
    drained, target, other = replicas
    held = [i for i, iid in first.items() if iid == drained]
    assert len(held) > 2
    planned = held[: len(held) // 2]
    world.inference.plan([(item, target) for item in planned])
    emitted.clear()
    assert sorted(world.remove_replica(drained, 0.0)) == sorted(held)
    again = {e.item: e.instance for e in emitted if isinstance(e, ev.ItemRouted)}
    assert set(again) == set(held)
    assert all(again[item] == target for item in planned)
    assert all(again[item] in (target, other) for item in held)


def test_a_held_trainer_starts_no_step_until_the_hold_lifts() -> None:
    """The modelled trainer honours the controller's hold at its step boundary, as
    the real one does (``Iteration._actor_ready``)."""
    cfg = small(16, "scheduler.mode=dynamic", "algorithm.minibatch_order=completion")
    graph, _ = build_hypergraph(cfg.job.pipeline_layout())
    emitted: list[ev.Event] = []
    actor = SimActor(
        graph,
        emitted.append,
        cfg.job.algorithm,
        cluster=build_cluster(cfg),
        tokens=lambda item: 1000,
        totals=WorldTotals(),
    )
    per_step = cfg.job.algorithm.samples_per_minibatch
    for k in range(per_step):
        actor.arrived(ItemId(f"s{k}"), GroupId(f"g{k // cfg.job.algorithm.group_size}"))
    graph.components[ACTOR].hold_steps = True
    actor.start(0.0)
    assert actor.next_time() == math.inf and not emitted
    graph.components[ACTOR].hold_steps = False
    actor.start(1.0)
    assert actor.next_time() > 1.0
    assert sum(isinstance(e, ev.ItemRouted) for e in emitted) == per_step


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("size", ["1.5b", "7b"])
def test_dynamic_is_never_worse_than_the_better_static_mode_on_the_agentic_settings(
    size: str,
) -> None:
    """On the reference agentic settings (64 devices) dynamic, with and without
    priority ordering, is at least as fast as the better static mode within 5%: with
    sessions sticky to their KV prefix the rollout is throughput-bound, so there is
    little to reclaim, but nothing may be lost either. The better static mode is
    colocated: static-disaggregated takes 1.4-2.3x its time on every seed of these rows
    (`bench/sim_paper.py`, which runs it), and simulating it here would cost CI
    about half a minute for a comparison that cannot decide the test."""
    from recipes.paper import paper_setting

    results = {}
    for mode in ("dynamic", "dynamic+priority", "static-colocated"):
        base, _, extra = mode.partition("+")
        cfg = paper_setting("agentic", size, 64, mode=base, num_iterations=2)
        if extra:
            cfg = simulated_run(cfg, ["sim.request_order=priority"])
        results[mode] = run(cfg, check=False)[0]
    best = results["static-colocated"].throughput
    assert results["dynamic"].throughput >= 0.95 * best
    assert results["dynamic+priority"].throughput >= 0.95 * best
