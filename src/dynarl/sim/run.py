"""Run the real controller against the simulated cluster and collect what it did.

:func:`simulate` wires one run: the hypergraph and policy a real run would build from
the configuration, a predictor seeded by the profile the simulator's models deliver,
:class:`~dynarl.sim.world.SimWorld` as event source (and its executor), and a timeline
recorder as listener. It runs on the current event loop, which must be a
:class:`~dynarl.core.virtual_time.VirtualTimeLoop` (an hour of cluster time then takes
seconds; on a real-clock loop it would take the hour, so it refuses).
:func:`run_simulation` runs it on a loop of its own, from synchronous code or, through
a worker thread, from a notebook. The result holds throughput, iteration times, busy
and idle device-seconds per component, and the distance to the work-conserving bound.
"""

import asyncio
import time
from collections.abc import Callable

import anyio
import msgspec
import numpy as np

from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.estimates import Estimates
from dynarl.control.modes import make_hold, make_policy
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.predictor import Predictor
from dynarl.core.virtual_time import VirtualClock, VirtualTimeLoop
from dynarl.obs.timeline import TimelineRecorder
from dynarl.sim.bound import work_conserving_bound
from dynarl.sim.cluster import ClusterModel, host_slowdown, sim_profile
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimulatedRun
from dynarl.sim.errors import SimError
from dynarl.sim.faults import SimFaults
from dynarl.sim.metrics import IterationRecord
from dynarl.sim.plan_accuracy import PlanAccuracy, plan_accuracy
from dynarl.sim.tail_floor import tail_floor_s
from dynarl.sim.world import SimWorld


class ComponentTime(msgspec.Struct, frozen=True, kw_only=True):
    """Device-seconds a component held devices, and of those how many did work."""

    held: float
    busy: float

    @property
    def idle(self) -> float:
        """Held but doing nothing (or a tail engine's time counts as busy)."""
        return max(0.0, self.held - self.busy)


class ModeResult(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated run, over its measured iterations (after the warm-up ones).

    ``throughput`` is generated tokens/s (math) or finished requests/s (agentic);
    ``bound_s`` the work-conserving bound of the same iterations and ``bound_gap``
    how far above it the run is (0.25: 25% slower than the bound);
    ``critical_path_s`` the longest request decoded alone; ``lower_bound_s`` the mean
    over the iterations of the larger of the work-conserving bound and the iteration's
    critical path (that request also scored and trained, and the weight sync), and
    ``lower_bound_gap`` how far above it the run is; ``tail_floor_s`` the mean of the
    iterations' tail floors (:mod:`~dynarl.sim.tail_floor`: a model estimate, not a
    bound, of what the longest responses' decode and the last minibatch cost every
    schedule).
    """

    mode: str
    unit: str
    throughput: float
    mean_iteration_s: float
    bound_s: float
    bound_gap: float
    critical_path_s: float
    lower_bound_s: float
    lower_bound_gap: float
    tail_floor_s: float
    devices: dict[str, ComponentTime]
    migration_device_s: float
    free_device_s: float
    num_migrations: int
    decision_p99_ms: float
    overhead: float
    """Wall-clock seconds the controller spent deciding over the simulated seconds
    (every iteration): the scheduler's online overhead, on this machine."""
    events_rejected: dict[str, int]
    iterations: list[IterationRecord]
    generated_tokens: int
    requested_tokens: int
    engine_tokens: int
    wall_s: float
    plan_accuracy: PlanAccuracy = PlanAccuracy()
    """How far the committed plans' predicted remaining iteration time was from the
    measured iterations' actual ends (:mod:`~dynarl.sim.plan_accuracy`)."""
    gap_s: dict[str, float] = msgspec.field(default_factory=dict)
    """Where the mean iteration's time above the work-conserving bound went, in seconds
    of the whole cluster (device-seconds over the devices), by cause: per component
    (``rollout``, ``inference``, ``actor``) its busy time beyond the bound's useful work
    (a rollout's thin batches and re-prefills, data-parallel loss), ``moving`` (devices
    migrating) and ``idle`` (held but idle, or free, less the weight sync the bound
    counts). They sum to ``mean_iteration_s - bound_s``."""


async def simulate(
    run: SimulatedRun,
    *,
    check: bool = False,
    name: str | None = None,
    on_event: Callable[[ev.Event], None] | None = None,
    cluster: ClusterModel | None = None,
    faults: SimFaults | None = None,
) -> tuple[ModeResult, TimelineRecorder]:
    """Simulate ``run`` (its job's ``scheduler.mode``) on the running loop, a
    :class:`~dynarl.core.virtual_time.VirtualTimeLoop`.

    Args:
        run: the job and the modelled cluster (``run.sim``: hardware, model, workload).
        check: verify the hypergraph's invariants after every event (slow; tests).
        name: the run's name in the timeline (default: the mode).
        on_event: also called with every applied event.
        cluster: the cost models and workload (default: built from ``run``).
        faults: failed moves and killed workers to inject (default: none); its
            records say what happened and how long recovery took.

    Returns:
        the measured result and the allocation timeline.

    Raises:
        SimError: the running loop keeps real time (it is not a ``VirtualTimeLoop``).
    """
    clock = VirtualClock(_require_virtual_time())
    cfg = run.job
    graph, baseline = build_hypergraph(cfg.pipeline_layout(), now_s=clock.now())
    cluster = cluster or build_cluster(run)
    # A "profiling run" on other prompts than the measured ones.
    sample = cluster.workload.generate(np.random.default_rng(cfg.run.seed + 1_000_003))
    profile = sim_profile(cluster, sample, cfg.cluster.num_devices, tail_tp=cfg.rollout.tail_tp)
    predictor = Predictor.for_pipeline(
        graph.spec, profile=profile, host_slowdown=host_slowdown(cluster, cfg.cluster.num_devices)
    )
    estimates = Estimates()  # shared by the policy and the hold
    policy = make_policy(cfg.scheduler, predictor, baseline, estimates)
    recorder = TimelineRecorder(graph, run=name or cfg.scheduler.mode)
    listeners: list[Callable[[ev.Event], None]] = []
    if check:
        listeners.append(lambda event: graph.check())
    listeners.append(recorder)
    if on_event is not None:
        listeners.append(on_event)

    def handle(event: ev.Event) -> None:
        controller.handle(event)  # bound below: the controller needs the world first

    world = SimWorld(graph, handle, clock, run, cluster=cluster)
    if faults is not None:
        faults.install(world)
        listeners.append(faults.on_event)
    controller = Controller(
        graph,
        policy,
        world.executor,
        clock=clock,
        predictor=predictor,
        tick_s=cfg.scheduler.tick_s,
        listeners=listeners,
        hold=make_hold(cfg.scheduler, predictor, estimates),
    )
    wall0 = time.perf_counter()
    send, receive = anyio.create_memory_object_stream[ev.Event](0)
    kills = anyio.CancelScope()

    async def kill_loop() -> None:
        with kills:
            if faults is not None:
                await faults.kill_loop()

    async with anyio.create_task_group() as tg, send:
        await tg.start(controller.run, receive)
        tg.start_soon(kill_loop)
        await world.run()
        kills.cancel()
    if faults is not None:
        faults.close(clock.now())
    wall_s = time.perf_counter() - wall0
    recorder.close(clock.now())
    result = _summarise(run, world, recorder, controller, wall_s)
    return result, recorder


def run_simulation(
    run: SimulatedRun,
    *,
    check: bool = False,
    name: str | None = None,
    on_event: Callable[[ev.Event], None] | None = None,
    cluster: ClusterModel | None = None,
) -> tuple[ModeResult, TimelineRecorder]:
    """Simulate ``run`` on a :class:`~dynarl.core.virtual_time.VirtualTimeLoop` of its
    own and return what :func:`simulate` returns (the arguments are its arguments).

    It blocks until the simulation ends, so call it from a thread that runs no event
    loop; in a notebook cell, run it in a worker thread:
    ``await anyio.to_thread.run_sync(run_simulation, run)`` (pass keyword arguments
    through ``functools.partial``).

    Raises:
        SimError: called from a thread that runs an event loop.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise SimError(
            f"run_simulation() blocks, and this thread runs an event loop ({type(loop).__name__}),"
            " as a notebook cell does: run it in a worker thread with"
            " `await anyio.to_thread.run_sync(run_simulation, run)`"
        )
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(simulate(run, check=check, name=name, on_event=on_event, cluster=cluster))


def _require_virtual_time() -> VirtualTimeLoop:
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # another async library (trio) runs this task
        loop = None
    if not isinstance(loop, VirtualTimeLoop):
        running = type(loop).__name__ if loop is not None else "not an asyncio loop"
        raise SimError(
            f"simulate() needs a VirtualTimeLoop, and the running loop ({running})"
            " keeps real time: the simulated cluster would run as slowly as a real one."
            " Use run_simulation(run) from synchronous code,"
            " `await anyio.to_thread.run_sync(run_simulation, run)` in a notebook or"
            " another running loop, or run simulate(run) in"
            " `asyncio.Runner(loop_factory=VirtualTimeLoop)`"
        )
    return loop


def _summarise(
    run: SimulatedRun,
    world: SimWorld,
    recorder: TimelineRecorder,
    controller: Controller,
    wall_s: float,
) -> ModeResult:
    cfg = run.job
    skip = min(run.sim.warmup_iterations, len(world.iterations) - 1)
    measured = world.iterations[skip:]
    total_s = sum(r.duration_s for r in measured)
    agentic = run.sim.workload == "agentic"
    work = sum(r.requests if agentic else r.generated_tokens for r in measured)
    n = cfg.cluster.num_devices
    tail = cfg.rollout.tail_tp
    bounds = [
        work_conserving_bound(world.cluster, world.workloads[r.iteration], n, tail_tp=tail)
        for r in measured
    ]
    bound_s = sum(b.iteration_s for b in bounds) / len(bounds)
    lower_s = sum(b.lower_bound_s for b in bounds) / len(bounds)
    floor_s = 0.0
    for r in measured:
        requests = world.workloads[r.iteration]
        floor = tail_floor_s(world.cluster, requests, n)
        if tail:
            floor = min(floor, tail_floor_s(world.cluster, requests, n, tail_tp=tail))
        floor_s += floor
    mean_s = total_s / len(measured)
    held: dict[str, float] = {}
    for r in measured:
        for label, secs in recorder.device_seconds(r.start_s, r.end_s).items():
            held[label] = held.get(label, 0.0) + secs
    devices = {
        c: ComponentTime(
            held=held.get(c, 0.0), busy=sum(r.busy_device_s.get(c, 0.0) for r in measured)
        )
        for c in ("rollout", "inference", "actor")
    }
    per_iteration = n * len(measured)
    gap = {
        c: (t.busy - sum(b.device_s.get(c, 0.0) for b in bounds)) / per_iteration
        for c, t in devices.items()
    }
    gap["moving"] = held.get("migrating", 0.0) / per_iteration
    idle = sum(t.idle for t in devices.values()) + held.get("free", 0.0)
    gap["idle"] = idle / per_iteration - sum(b.serial_s for b in bounds) / len(bounds)
    stats = controller.statistics()
    decisions = sorted(stats.decision_s) or [0.0]
    # Every trained request's tokens, and those of the requests still carried over
    # (partial rollouts) as far as they got.
    requested = sum(r.total_output_tokens for w in world.workloads for r in w)
    requested += sum(seq.generated() for seq in world.seqs.values())
    return ModeResult(
        mode=cfg.scheduler.mode,
        unit="requests/s" if agentic else "tokens/s",
        throughput=work / total_s if total_s > 0 else 0.0,
        mean_iteration_s=mean_s,
        bound_s=bound_s,
        bound_gap=mean_s / bound_s - 1.0,
        critical_path_s=max(b.critical_path_s for b in bounds),
        lower_bound_s=lower_s,
        lower_bound_gap=mean_s / lower_s - 1.0,
        tail_floor_s=floor_s / len(measured),
        devices=devices,
        migration_device_s=held.get("migrating", 0.0),
        free_device_s=held.get("free", 0.0),
        num_migrations=stats.migrations_done + stats.migrations_failed,
        decision_p99_ms=decisions[min(len(decisions) - 1, int(0.99 * len(decisions)))] * 1e3,
        overhead=stats.decision_total_s / max(sum(r.duration_s for r in world.iterations), 1e-9),
        events_rejected=stats.events_rejected,
        iterations=world.iterations,
        generated_tokens=world.totals.generated_tokens,
        requested_tokens=requested,
        engine_tokens=world.engine_generated_tokens(),
        wall_s=wall_s,
        plan_accuracy=plan_accuracy(stats.plans, measured),
        gap_s=gap,
    )
