"""Devices sharing one host's cores: the predictor reads the host's slowdown curve, so
on a saturated host more devices predict no more throughput and the scheduler does not
move devices for nothing; without a curve nothing changes."""

import pytest

from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.policies.bottleneck import BottleneckPolicy
from dynarl.control.policies.gate import PredictorGate
from dynarl.control.policies.phases import RolloutBorrowsActor
from dynarl.control.predictor import Predictor, cores_slowdown, host_factor
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT
from dynarl.core.errors import ConfigError
from dynarl.core.ids import ComponentId

from .graphs import make_graph
from .test_policies import enqueue, tick

SATURATED = (1.0, 2.0, 3.0, 4.0)  # 1..4 busy devices share one device's compute
R, A = ComponentId("rollout"), ComponentId("actor")


def decode_rate(n: int, load: float) -> float:
    return load / (0.02 + 0.0005 * load / n)


def fitted(graph: Hypergraph, host: tuple[float, ...]) -> Predictor:
    """A predictor seeded as a profiling run on ``host`` would measure: each rate of
    independent devices divided by the host's slowdown at the devices kept busy."""
    p = Predictor({c: n.spec.scaling for c, n in graph.components.items()}, host_slowdown=host)
    for n in (1, 2, 4):
        for load in (1, 8, 64):
            busy = min(n, load)
            p.observe(ROLLOUT, n, load, decode_rate(n, load) / host_factor(host, busy))
        p.observe(INFERENCE, n, 512, 100.0 * n / host_factor(host, n))
        p.observe(ACTOR, n, 512, 10.0 * n / host_factor(host, n))
    return p


def test_on_a_saturated_host_more_devices_predict_no_more_throughput() -> None:
    p = Predictor({R: "concave", A: "linear"}, host_slowdown=SATURATED)
    free = Predictor({R: "concave", A: "linear"})
    for n in (1, 2, 4):
        for load in (4, 32, 128):
            p.observe(R, n, load, decode_rate(n, load) / min(n, load))
            free.observe(R, n, load, decode_rate(n, load))
        p.observe(A, n, 1024, 10.0)  # n devices of a saturated host: one device's worth
        free.observe(A, n, 1024, 10.0 * n)
    for n in (2, 4, 8):  # 8: past the curve, still saturated
        assert p.predict(R, n, 128).throughput <= p.predict(R, 1, 128).throughput
        assert p.predict(A, n, 1024).throughput == pytest.approx(10.0, rel=1e-3)
    # The fit itself is the independent devices' one: the curve is all that differs.
    shared, alone = p.step_costs(R), free.step_costs(R)
    assert shared is not None and alone is not None
    assert (shared.a, shared.b) == pytest.approx((alone.a, alone.b), rel=1e-6)
    assert free.predict(A, 4, 1024).throughput == pytest.approx(40.0, rel=1e-3)


def test_a_malformed_host_curve_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"host_slowdown\[0\]"):
        Predictor({R: "concave"}, host_slowdown=(2.0, 3.0))
    with pytest.raises(ConfigError, match=r"host_slowdown\[1\]"):
        Predictor({R: "concave"}, host_slowdown=(1.0, 0.0))


def rollout_with_work(*, free: int) -> Hypergraph:
    g = make_graph(rollout=1, inference=1, actor=2, free=free, actor_sizes=(1, 2, 4))
    g.apply(ev.IterationStarted(iteration=0))
    enqueue(g, PROMPTS, 256, "p")
    return g


def test_the_bottleneck_policy_adds_no_slots_to_a_saturated_host() -> None:
    cfg = SchedulerConfig()
    g = rollout_with_work(free=2)
    plan = BottleneckPolicy(cfg, fitted(g, ())).decide(g, tick(1.0))
    assert any(m.dst == ROLLOUT for m in plan.migrations)  # independent devices: it pays
    assert not BottleneckPolicy(cfg, fitted(g, SATURATED)).decide(g, tick(1.0))


def test_the_gate_refuses_borrowing_the_actor_on_a_saturated_host() -> None:
    cfg = SchedulerConfig()
    rule = RolloutBorrowsActor({ROLLOUT: 1, INFERENCE: 1, ACTOR: 2}, cfg)
    g = rollout_with_work(free=0)
    start = tick(0.0, "iteration_start")
    independent = PredictorGate(rule, fitted(g, ()), min_gain=0.0).decide(g, start)
    assert [(m.src, m.dst) for m in independent.migrations] == [(ACTOR, ROLLOUT)]
    assert not PredictorGate(rule, fitted(g, SATURATED), min_gain=0.0).decide(g, start)


def test_cpu_slots_without_a_measured_curve_share_the_cores_ideally() -> None:
    # 4 one-thread slots on 2 cores: two run at full speed, four at half.
    assert cores_slowdown(4, 1, 2) == (1.0, 1.0, 1.5, 2.0)
    assert cores_slowdown(2, 2, 2) == (1.0, 2.0)
