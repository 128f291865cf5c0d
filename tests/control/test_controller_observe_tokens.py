"""With sized items the controller teaches the predictor the stages after rollout in
tokens: the trainer's rate is the tokens of the samples each optimizer step completed
per second, and inference's capacity the tokens it completed per occupied
instance-second. Without sizes both stay in samples."""

import pytest

from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.control.topology import ACTOR, INFERENCE, TO_ACTOR, TO_INFERENCE
from dynarl.core.clock import ManualClock
from dynarl.core.ids import ComponentId, GroupId, InstanceId, ItemId

from .graphs import make_graph
from .test_controller_observe import GAP_S, SERVICE_S, DoNothing, NoMoves


class RecordingPredictor(Predictor):
    """A predictor that remembers what it was fed."""

    def __init__(self, graph: Hypergraph) -> None:
        super().__init__({c: n.spec.scaling for c, n in graph.components.items()})
        self.seen: list[tuple[ComponentId, int, float, float]] = []

    def observe(self, component: ComponentId, devices: int, load: float, throughput: float) -> None:
        self.seen.append((component, devices, load, throughput))
        super().observe(component, devices, load, throughput)

    def of(self, cid: ComponentId) -> list[tuple[int, float, float]]:
        return [(d, load, rate) for c, d, load, rate in self.seen if c == cid]


def controller_for(g: Hypergraph) -> tuple[Controller, ManualClock, RecordingPredictor]:
    predictor = RecordingPredictor(g)
    clock = ManualClock()
    controller = Controller(g, DoNothing(), NoMoves(), clock=clock, predictor=predictor)
    return controller, clock, predictor


def train_step(
    controller: Controller,
    clock: ManualClock,
    step: int,
    sizes: list[int | None],
    duration_s: float,
) -> None:
    """The two trainer replicas train one sample each of ``sizes`` (tokens; ``None``:
    no size reported), then the step is reported."""
    replicas = [InstanceId("actor-0"), InstanceId("actor-1")]
    items = [ItemId(f"s{step}-{k}") for k in range(len(sizes))]
    refs = tuple(
        ev.ItemRef(i, GroupId(f"g{step}")) if n is None else ev.ItemRef(i, GroupId(f"g{step}"), n)
        for i, n in zip(items, sizes, strict=True)
    )
    controller.handle(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
    for k, item in enumerate(items):
        controller.handle(ev.ItemRouted(edge=TO_ACTOR, item=item, instance=replicas[k % 2]))
    clock.advance(duration_s)
    for k, item in enumerate(items):
        controller.handle(ev.ItemCompleted(edge=TO_ACTOR, item=item, instance=replicas[k % 2]))
    controller.handle(
        ev.TrainStepDone(
            component=ACTOR,
            step=step,
            num_steps=3,
            num_samples=len(items),
            duration_s=duration_s,
        )
    )


def test_the_trainer_is_observed_in_tokens_per_second_of_each_step() -> None:
    g = make_graph(rollout=2, inference=2, actor=2)
    controller, clock, predictor = controller_for(g)
    train_step(controller, clock, 0, [1000, 3000], 2.0)
    # Only the samples of the step just ended count, not everything trained so far.
    train_step(controller, clock, 1, [200, 600], 0.5)
    train_step(controller, clock, 2, [100, 100, 100, 100], 4.0)
    seen = predictor.of(ACTOR)
    assert [(devices, load) for devices, load, _ in seen] == [(2, 2), (2, 2), (2, 4)]  # samples
    assert [rate for _, _, rate in seen] == pytest.approx([4000 / 2.0, 800 / 0.5, 400 / 4.0])
    assert predictor.predict(ACTOR, 2, 2).num_observations == 3


def test_without_sizes_the_trainer_is_observed_in_samples_per_second() -> None:
    g = make_graph(rollout=2, inference=2, actor=2)
    controller, clock, predictor = controller_for(g)
    train_step(controller, clock, 0, [None, None], 2.0)
    train_step(controller, clock, 1, [None, None, None, None], 0.5)
    assert not g.sized
    seen = predictor.of(ACTOR)
    assert [(devices, load) for devices, load, _ in seen] == [(2, 2), (2, 4)]
    assert [rate for _, _, rate in seen] == pytest.approx([2 / 2.0, 4 / 0.5])


def test_inference_occupancy_is_observed_in_tokens() -> None:
    """As in test_controller_observe's starved stage: each cycle each of two replicas
    holds one sample for SERVICE_S, then waits GAP_S. The samples are 100 and 300
    tokens long: 400 tokens per 2 * SERVICE_S instance-seconds, times two replicas."""
    g = make_graph(rollout=2, inference=2, actor=2)
    controller, clock, predictor = controller_for(g)
    replicas = [InstanceId("inference-0"), InstanceId("inference-1")]
    tau = g.components[INFERENCE].work_rate.tau_s
    cycles = 4 * int(2 * tau / (2 * SERVICE_S))
    for k in range(cycles):
        items = [ItemId(f"s{k}-{r}") for r in range(2)]
        refs = tuple(
            ev.ItemRef(i, GroupId(f"g{k}"), n) for i, n in zip(items, (100, 300), strict=True)
        )
        controller.handle(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs))
        controller._observe_tick(clock.now())
        for item, iid in zip(items, replicas, strict=True):
            controller.handle(ev.ItemRouted(edge=TO_INFERENCE, item=item, instance=iid))
        clock.advance(SERVICE_S)
        for item, iid in zip(items, replicas, strict=True):
            controller.handle(ev.ItemCompleted(edge=TO_INFERENCE, item=item, instance=iid))
        clock.advance(GAP_S)
    seen = predictor.of(INFERENCE)
    assert len(seen) >= 3
    for devices, load, rate in seen:
        assert devices == 2
        assert rate == pytest.approx(400 / (2 * SERVICE_S) * 2)  # 4000 tokens/s
        assert load == int(load) and load <= 2 * cycles  # samples, not tokens
    assert g.components[INFERENCE].work_completed == pytest.approx(400.0 * cycles)
