"""The controller runs the real loop against in-process fake workers on virtual time."""

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.modes import make_policy
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.plan import EMPTY_PLAN, Migration, Plan
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Trigger
from dynarl.control.topology import INFERENCE, PROMPTS, ROLLOUT, TO_INFERENCE
from dynarl.core.clock import LoopClock, ManualClock
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.testing.harness import HarnessResult, fake_profile, run_with_fake_world
from dynarl.testing.world import FakeWorldConfig

from .graphs import make_graph

T = TypeVar("T")

WORLD = FakeWorldConfig(
    num_prompts=16,
    group_size=4,
    n_minibatches=2,
    num_iterations=2,
    median_tokens=60,
    max_tokens=600,
    actor_items_per_s=10.0,
    max_iteration_s=600,
)
CLUSTER = [
    "cluster.num_devices=6",
    "rollout.initial_devices=3",
    "inference.initial_devices=1",
    "actor.initial_devices=2",
    "algorithm.num_prompts=16",
    "algorithm.group_size=4",
]


def virtual(fn: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(fn())  # type: ignore[arg-type]


def run_mode(mode: str, **kwargs: object) -> HarnessResult:
    cfg = apply_overrides(DynaRLConfig(), [*CLUSTER, f"scheduler.mode={mode}"])
    return virtual(
        lambda: run_with_fake_world(
            cfg, WORLD, profile=fake_profile(WORLD, 6), check=True, **kwargs
        )
    )  # type: ignore[arg-type]


def test_virtual_time_loop_jumps_over_sleeps() -> None:
    async def main() -> float:
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for k in range(100):
                tg.start_soon(anyio.sleep, 3600.0 * k / 100)
        return anyio.current_time() - start

    assert virtual(main) == pytest.approx(3564.0)


@pytest.mark.parametrize("mode", ["dynamic", "static-colocated", "static-disaggregated"])
def test_every_mode_completes_iterations_with_consistent_state(mode: str) -> None:
    result = run_mode(mode)
    assert len(result.iteration_times_s) == WORLD.num_iterations
    assert result.stats.events_rejected == {}
    assert result.stats.migrations_failed == 0
    for _, devices in result.allocation:
        assert sum(devices.values()) <= 6
    if mode == "static-disaggregated":
        assert not result.migrations
    else:
        assert result.migrations
    # Each committed plan is kept with what its policy predicted of it: the dynamic
    # mode's scored plans a finite remaining time that the plan shortens.
    plans = result.stats.plans
    assert len(plans) == result.stats.plans_committed
    assert [p.time_s for p in plans] == sorted(p.time_s for p in plans)
    scored = [p for p in plans if p.predicted_s > 0]
    if mode == "dynamic":
        assert scored and all(p.predicted_s < p.predicted_without_s for p in scored)
    else:
        assert not scored  # the static modes do not score their plans
    if mode == "static-colocated":
        # Every stage in turn holds the whole cluster (the actor at its largest valid
        # data-parallel size: 4 divides the 32-sample minibatch, 6 does not).
        assert any(devices.get("actor") == 4 for _, devices in result.allocation)
        assert any(devices.get("rollout") == 6 for _, devices in result.allocation)


def test_failed_migrations_leave_the_old_placement_and_the_run_goes_on() -> None:
    failed: list[Migration] = []

    def fail_first_move_to_inference(m: Migration) -> bool:
        if m.dst == "inference" and not failed:
            failed.append(m)
            return True
        return False

    result = run_mode("static-colocated", fail=fail_first_move_to_inference)
    assert failed
    assert result.stats.migrations_failed > 0
    assert len(result.iteration_times_s) == WORLD.num_iterations
    assert result.stats.events_rejected == {}


class RecordingExecutor:
    def __init__(self) -> None:
        self.seen: list[Migration] = []

    async def execute(self, migration: Migration) -> None:
        self.seen.append(migration)
        await anyio.sleep(2.0)


def test_controller_applies_streamed_events_rejects_bad_ones_and_decides(caplog) -> None:
    cfg = apply_overrides(DynaRLConfig(), [*CLUSTER, "scheduler.mode=static-colocated"])

    async def main() -> tuple[Controller, RecordingExecutor, float]:
        graph, baseline = build_hypergraph(cfg.pipeline_layout())
        predictor = Predictor({c: n.spec.scaling for c, n in graph.components.items()})
        executor = RecordingExecutor()
        controller = Controller(
            graph,
            make_policy(cfg.scheduler, predictor, baseline),
            executor,
            clock=LoopClock(),
            predictor=predictor,
            tick_s=0.5,
        )
        send, receive = anyio.create_memory_object_stream[ev.Event](16)
        async with anyio.create_task_group() as tg:
            await tg.start(controller.run, receive)
            async with send:
                await send.send(ev.WorkerIdle(instance=InstanceId("ghost")))
                await send.send(ev.WorkerIdle(instance=InstanceId("ghost")))
                await send.send(ev.IterationStarted(iteration=0))  # colocated: all to rollout
                await anyio.sleep(5.0)
            end = anyio.current_time()
        return controller, executor, end

    with caplog.at_level(logging.WARNING, logger="dynarl.control.controller"):
        controller, executor, end = virtual(main)
    stats = controller.statistics()
    assert stats.events_rejected == {"WorkerIdle": 2}
    assert len([r for r in caplog.records if "rejected" in r.message]) == 1  # logged once
    assert {m.dst for m in executor.seen} == {"rollout"}
    assert stats.migrations_done == len(executor.seen)
    assert controller.graph.components["rollout"].num_active_devices == 6
    assert stats.decisions >= 10  # ticks kept coming on virtual time
    assert sum(t.decisions for t in stats.triggers.values()) == stats.decisions
    assert stats.triggers["iteration_start"].plans == 1  # the move to rollout
    assert stats.triggers["tick"].decisions >= 9
    assert sum(t.total_s for t in stats.triggers.values()) == pytest.approx(stats.decision_total_s)
    assert controller.predictor is not None
    assert controller.predictor.migration_cost("reshard") < 2.0  # learned from the 2 s moves
    assert not controller.graph.migrations
    assert end >= 5.0


def test_commit_outside_a_running_controller_is_an_error() -> None:
    cfg = apply_overrides(DynaRLConfig(), [*CLUSTER, "scheduler.mode=static-colocated"])
    graph, baseline = build_hypergraph(cfg.pipeline_layout())
    predictor = Predictor({c: n.spec.scaling for c, n in graph.components.items()})
    controller = Controller(
        graph,
        make_policy(cfg.scheduler, predictor, baseline),
        RecordingExecutor(),
        clock=LoopClock(),
    )
    with pytest.raises(RuntimeError, match="not running"):
        controller.decide(Trigger(kind="iteration_start", time_s=0.0))


class AlwaysFails:
    def __init__(self) -> None:
        self.attempts: list[float] = []

    async def execute(self, migration: Migration) -> None:
        self.attempts.append(anyio.current_time())
        await anyio.sleep(0.5)
        raise RuntimeError("no route to that device")


def test_a_failing_move_is_retried_with_exponential_back_off() -> None:
    cfg = apply_overrides(DynaRLConfig(), [*CLUSTER, "scheduler.mode=static-colocated"])

    async def main() -> tuple[Controller, AlwaysFails]:
        graph, baseline = build_hypergraph(cfg.pipeline_layout())
        predictor = Predictor({c: n.spec.scaling for c, n in graph.components.items()})
        executor = AlwaysFails()
        controller = Controller(
            graph,
            make_policy(cfg.scheduler, predictor, baseline),
            executor,
            clock=LoopClock(),
            tick_s=1.0,
            max_backoff_s=16.0,
        )
        send, receive = anyio.create_memory_object_stream[ev.Event](4)
        async with anyio.create_task_group() as tg:
            await tg.start(controller.run, receive)
            async with send:
                # Colocated moves every device to rollout at iteration start, and
                # retries whenever the placement changes (here: each failure).
                await send.send(ev.IterationStarted(iteration=0))
                refs = tuple(ev.ItemRef(ItemId(f"p{k}"), GroupId("g")) for k in range(4))
                await send.send(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
                await anyio.sleep(120.0)
        return controller, executor

    controller, executor = virtual(main)
    stats = controller.statistics()
    starts = sorted(set(executor.attempts))
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Without back-off each failure would be retried at once (every ~0.5 s: ~240 tries).
    assert 5 <= len(starts) <= 15, starts
    assert gaps == sorted(gaps) and max(gaps) <= 16.0 + 1.5 + 0.5
    assert stats.plans_held_back > 0
    assert len(stats.plans) == stats.plans_committed  # a held-back plan is not committed
    assert controller.graph.components["rollout"].num_active_devices == 3  # old placement kept


class RecordingPolicy:
    """Plans nothing; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str | None]] = []

    def decide(self, graph: object, trigger: Trigger) -> Plan:
        self.asked.append((trigger.kind, trigger.component))
        return EMPTY_PLAN


def test_a_stage_is_drained_once_nothing_upstream_of_it_works_either() -> None:
    """The scorer running dry between two rollout completions is a lull the tick
    covers, not a decision; its last sample, after the rollout's last, is one."""
    graph = make_graph()
    policy = RecordingPolicy()
    controller = Controller(graph, policy, RecordingExecutor(), clock=ManualClock())
    samples = [ev.ItemRef(ItemId(f"s{k}"), GroupId("g")) for k in range(2)]
    rollout, scorer = InstanceId("rollout-0"), InstanceId("inference-0")

    def generate(k: int) -> None:
        controller.handle(ev.ItemRouted(edge=PROMPTS, item=ItemId(f"s{k}"), instance=rollout))
        controller.handle(ev.ItemCompleted(edge=PROMPTS, item=ItemId(f"s{k}"), instance=rollout))
        controller.handle(ev.ItemsEnqueued(edge=TO_INFERENCE, items=(samples[k],)))

    def score(k: int) -> None:
        controller.handle(ev.ItemRouted(edge=TO_INFERENCE, item=ItemId(f"s{k}"), instance=scorer))
        controller.handle(
            ev.ItemCompleted(edge=TO_INFERENCE, item=ItemId(f"s{k}"), instance=scorer)
        )

    controller.handle(ev.ItemsEnqueued(edge=PROMPTS, items=tuple(samples)))
    generate(0)
    score(0)  # the scorer is empty, the rollout still works on s1
    assert ("stage_drained", INFERENCE) not in policy.asked
    generate(1)
    assert policy.asked == [("stage_drained", ROLLOUT)]
    score(1)
    assert policy.asked == [("stage_drained", ROLLOUT), ("stage_drained", INFERENCE)]
    counts = controller.statistics().triggers
    assert set(counts) == {"stage_drained"}
    assert (counts["stage_drained"].decisions, counts["stage_drained"].plans) == (2, 0)
