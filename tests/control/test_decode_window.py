"""A rollout whose engines count their steps is fitted on its decode rate alone, with
its prefills priced apart: prefill stalls that swing its recent rate (sessions coming
back from their tools) no longer read as noise in the decode fit."""

import random

import pytest

from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.decode_window import DecodeWindows
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import Profile
from dynarl.control.topology import ROLLOUT
from dynarl.core.clock import ManualClock
from dynarl.core.ids import InstanceId

from .test_controller_observe import DoNothing, NoMoves, rollout_graph

A, B, C = 0.02, 1e-4, 1e-7  # the engines' decode step: A + (B + C * context) * batch
TICK_S = 0.5
P_SOME = 1e-4  # prefill seconds per generated token


class CountingEngines:
    """Two engines that count their steps: each report window they decode at the step
    cost and prefill ``prefill`` seconds per token they generate (sessions coming back
    with new tokens to take in), the batch stalled meanwhile."""

    def __init__(self, controller: Controller, clock: ManualClock) -> None:
        self.controller, self.clock = controller, clock
        self.steps = [0, 0]
        self.tokens = [0, 0]
        self.decode_s = [0.0, 0.0]
        self.prefill_s = [0.0, 0.0]
        self.resume_s = [0.0, 0.0]

    def run(
        self,
        running: int,
        context: int,
        prefill: float,
        engines: tuple[int, ...] = (0, 1),
        *,
        resume_s: float = 0.0,
    ) -> None:
        """One tick: ``TICK_S`` pass, the engines report, the controller observes.
        ``resume_s``: seconds of it each engine spends re-prefilling moved requests."""
        self.clock.advance(TICK_S)
        step = A + (B + C * context) * running
        for i in engines:
            steps = int((TICK_S - resume_s) / (step + prefill * running))
            self.steps[i] += steps
            self.tokens[i] += steps * running
            self.decode_s[i] += steps * step
            self.prefill_s[i] += steps * running * prefill + resume_s  # (idle for the rest)
            self.resume_s[i] += resume_s
            self.controller.handle(
                ev.EngineStats(
                    instance=InstanceId(f"rollout-{i}"),
                    kv_usage=min(1.0, running * context / 1e6),
                    num_running=running,
                    num_queued=0,
                    gen_tokens_per_s=steps * running / TICK_S,
                    kv_tokens=running * context,
                    decode_steps=self.steps[i],
                    decode_tokens=self.tokens[i],
                    decode_s=self.decode_s[i],
                    prefill_s=self.prefill_s[i],
                    resume_prefill_s=self.resume_s[i],
                )
            )
        self.controller._observe_tick(self.clock.now())


def counting_setup(
    profile: Profile | None = None,
) -> tuple[Hypergraph, Controller, Predictor, CountingEngines]:
    g = rollout_graph(max_running=64)
    predictor = Predictor({c: n.spec.scaling for c, n in g.components.items()}, profile=profile)
    clock = ManualClock()
    controller = Controller(g, DoNothing(), NoMoves(), clock=clock, predictor=predictor)
    return g, controller, predictor, CountingEngines(controller, clock)


def test_prefill_stalls_that_swing_the_rate_leave_the_decode_fit_exact() -> None:
    # Each half-second the engines prefill a random 0-2x of P seconds per token they
    # generate: at a full batch their summed recent rate swings nearly twofold at a
    # constant running count (what broke the fit on simulated agentic rollouts). The
    # decode fit sees the steps alone; the prefills are priced per token.
    p = 2e-4
    rng = random.Random(0)
    _, _, predictor, engines = counting_setup()
    for running, context in [(64, 500), (64, 2000), (32, 4000), (16, 8000), (8, 12000)]:
        for _ in range(40):
            engines.run(running, context, p * rng.uniform(0.0, 2.0))
    costs = predictor.step_costs(ROLLOUT)
    assert costs is not None
    assert (costs.a, costs.b) == pytest.approx((A, B), rel=0.03)
    # (Windows that straddle a jump in context mix two; real contexts grow smoothly.)
    assert costs.c == pytest.approx(C, rel=0.1)
    assert predictor.predict(ROLLOUT, 2, 128).rel_std < 0.01
    # The prefill device-seconds per generated token (one device an engine).
    assert costs.prefill == pytest.approx(p, rel=0.1)
    # What the engines deliver at a full batch, prefills included.
    step = A + (B + C * 1000) * 64
    got = predictor.predict(ROLLOUT, 2, 128, context=1000).throughput
    assert got == pytest.approx(2.0 / (step / 64 + p), rel=0.05)
    assert got < 0.8 * 128 / step


def test_a_window_covers_the_same_engines_and_restarts_when_one_leaves() -> None:
    g, controller, predictor, engines = counting_setup()
    span = g.rate_tau_s
    ticks = int(span / TICK_S)
    for _ in range(ticks):
        engines.run(32, 1000, P_SOME)
    assert predictor.predict(ROLLOUT, 2, 64).num_observations == 0  # under a span yet
    engines.run(32, 1000, P_SOME)
    assert predictor.predict(ROLLOUT, 2, 64).num_observations == 1
    # rollout-1 leaves: the window starts again on rollout-0 alone.
    controller.handle(ev.WorkerFailed(instance=InstanceId("rollout-1"), reason="gone"))
    for _ in range(ticks):
        engines.run(32, 1000, P_SOME, engines=(0,))
    assert predictor.predict(ROLLOUT, 1, 32).num_observations == 1
    engines.run(32, 1000, P_SOME, engines=(0,))
    assert predictor.predict(ROLLOUT, 1, 32).num_observations == 2


def test_an_engine_that_does_not_count_steps_leaves_the_rollout_on_its_reported_rates() -> None:
    g = rollout_graph(max_running=8)
    windows = DecodeWindows(g.rate_tau_s)
    g.apply(
        ev.EngineStats(
            instance=InstanceId("rollout-0"),
            kv_usage=0.1,
            num_running=8,
            num_queued=0,
            gen_tokens_per_s=100.0,
            time_s=1.0,
        )
    )
    for t in (1.0, 10.0, 20.0):
        assert windows.sample(g.components[ROLLOUT], t) is None


def test_a_moved_requests_re_prefill_is_not_the_workloads_prefill() -> None:
    # A migration's re-prefills are priced where the move is scored: the engines count
    # them apart (``resume_prefill_s``), so while they re-prefill moved requests the
    # decode fit goes on and the workload's prefill share does not move.
    _, _, predictor, engines = counting_setup()
    for _ in range(40):
        engines.run(32, 1000, P_SOME)
    before = predictor.step_costs(ROLLOUT)
    assert before is not None and before.prefill == pytest.approx(P_SOME, rel=0.05)
    observed = predictor.predict(ROLLOUT, 2, 64).num_observations
    for _ in range(10):  # a 4 s stall, mostly re-prefill
        engines.run(32, 1000, P_SOME, resume_s=0.4)
    after = predictor.step_costs(ROLLOUT)
    assert after is not None and after.prefill == pytest.approx(P_SOME, rel=0.05)
    step = A + (B + C * 1000) * 32  # the decode step the engines ran throughout
    assert after.a + (after.b + after.c * 1000) * 32 == pytest.approx(step, rel=0.01)
    assert predictor.predict(ROLLOUT, 2, 64).num_observations == observed + 10
    # Counted as the workload's own, the stall would have read as ten times the share.
    _, _, blind, engines = counting_setup()
    for _ in range(40):
        engines.run(32, 1000, P_SOME)
    for _ in range(10):
        engines.run(32, 1000, P_SOME + 0.4 / (32 * 20))
    mixed = blind.step_costs(ROLLOUT)
    assert mixed is not None and mixed.prefill > 1.5 * P_SOME


def test_the_prefill_share_is_the_components_at_both_engine_sizes() -> None:
    # Engines of the tail's size take only moved requests (no fresh ones to learn the
    # prefill from); a prefill is compute-bound, so its device-seconds per generated
    # token learned on the engines of the rollout's size hold for both.
    predictor = Predictor({ROLLOUT: "concave"}, tail_devices_per_instance={ROLLOUT: 2})
    for n in (1, 2, 4, 8) * 3:
        predictor.observe(ROLLOUT, n, 8 * n, 100.0 * n, unit=1)
        predictor.observe(ROLLOUT, 2 * n, 8 * n, 150.0 * n, unit=2)
        predictor.observe_prefill(ROLLOUT, n, 8 * n, 0.5 * n, 1000.0 * n)
    narrow, wide = predictor.step_costs(ROLLOUT, 1), predictor.step_costs(ROLLOUT, 2)
    assert narrow is not None and wide is not None
    assert narrow.prefill == wide.prefill == pytest.approx(5e-4)
    assert (wide.a, wide.b) != pytest.approx((narrow.a, narrow.b))
