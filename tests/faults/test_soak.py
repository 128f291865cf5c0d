"""The fault soak: 200 simulated iterations of the real controller while moves fail
(refused, or midway after draining) and rollout engines and inference replicas are
killed at random. The hypergraph's invariants hold after every event, every iteration
completes, and no sample is lost or duplicated; killed workers' requests run again
and their devices are rebooted."""

import asyncio

import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import simulated_run
from dynarl.sim.faults import FaultPlan
from dynarl.sim.soak import SOAK_JOB, soak


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hundred_iterations_with_random_faults_lose_nothing() -> None:
    run = simulated_run(DynaRLConfig(), [*SOAK_JOB, "run.num_iterations=200"])
    plan = FaultPlan(move_failure_rate=0.3, mean_kill_interval_s=60.0, seed=0)
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        summary, records = runner.run(soak(run, plan))  # check() after every event
    result = summary.result
    assert summary.iterations == 200
    assert summary.samples == summary.samples_expected == 200 * 32
    assert summary.lost == summary.duplicated == 0
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert result.events_rejected == {}
    kinds = summary.kinds
    assert set(kinds) == {
        "move_refused",
        "move_failed_midway",
        "rollout_killed",
        "inference_killed",
    }
    killed = [r for r in records if r.kind.endswith("_killed")]
    assert len(killed) >= 10 and all(r.recovery_s is not None for r in killed)
    assert sum(r.lost_items for r in killed) > 0  # workers died holding requests
    assert sum(k.devices_rebooted for k in kinds.values()) > 0


def test_a_fault_plan_is_off_by_default_and_checks_its_values() -> None:
    assert FaultPlan() == FaultPlan(move_failure_rate=0.0, mean_kill_interval_s=0.0)
    with pytest.raises(ValueError, match=r"move_failure_rate=1\.5"):
        FaultPlan(move_failure_rate=1.5)
    with pytest.raises(ValueError, match="mean_kill_interval_s=-1"):
        FaultPlan(mean_kill_interval_s=-1)
