"""Workers killed (SIGKILL) at chosen points of real runs of the default job
(dynamic scheduling, 4 devices): a dead rollout or inference slot is scale-in (its
requests go to the survivors with their partial output, its weight-sync group is
rebuilt without it, and its device is rebooted with a new slot process); the iteration
completes, every sample finishes each stage exactly once, and the rewards stay those
of a fault-free run. A dead trainer rank cannot be survived yet: the run stops at
once with an error that says so and how to resume, instead of hanging."""

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL, TrainerRankLostError
from dynarl.testing.faults import FaultInjector, WorkerKill

pytestmark = pytest.mark.slow

# The default job's rewards without faults (measured on this job, three runs; dynamic
# scheduling moves work between engines, which changes the sums' order: +-0.02).
FAULT_FREE_REWARDS = [0.071, 0.136, 0.157, 0.180, 0.158]
REWARD_NOISE = 0.06

KILLS = [
    WorkerKill(target="rollout", point="rollout", iteration=1),
    WorkerKill(target="inference", point="scoring", iteration=2),
    WorkerKill(target="rollout", point="migration", iteration=3),
    WorkerKill(target="rollout", point="weight_sync", iteration=4),
]


def job(run_dir: Path, *overrides: str) -> DynaRLConfig:
    return apply_overrides(
        DynaRLConfig(), ["run.checkpoint_every=0", f"run.run_dir={run_dir}", *overrides]
    )


async def run_with(cfg: DynaRLConfig, kills: Sequence[WorkerKill]) -> tuple[DynaRL, FaultInjector]:
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, list(kills))
        injector.attach()
        await rl.run()
    return rl, injector


@pytest.mark.timeout(900)
async def test_killed_rollout_and_inference_slots_lose_no_sample(tmp_path: Path) -> None:
    cfg = job(tmp_path / "run", "run.num_iterations=5")
    rl, injector = await run_with(cfg, KILLS)
    fired = [(k.kill.target, k.kill.point, k.kill.iteration) for k in injector.kills]
    assert fired, "no worker was killed"
    samples = cfg.algorithm.samples_per_iteration
    for (iteration, edge), counts in injector.completions().items():
        assert len(counts) == samples, (iteration, edge, len(counts))  # none lost
        assert set(counts.values()) == {1}, (iteration, edge)  # none twice
    rewards = [s.mean_reward for s in rl.history]
    assert len(rewards) == 5
    for got, want in zip(rewards, FAULT_FREE_REWARDS, strict=True):
        assert abs(got - want) < REWARD_NOISE, (rewards, fired)


@pytest.mark.timeout(600)
async def test_a_killed_trainer_rank_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    cfg = job(tmp_path / "run", "run.num_iterations=3")
    kill = WorkerKill(target="trainer", point="optimizer_step", iteration=1)
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, [kill])
        injector.attach()
        with pytest.raises(TrainerRankLostError) as caught:
            await rl.run()
        stopped = time.monotonic() - injector.kills[0].time_s
    assert stopped < 60, f"took {stopped:.0f} s to notice"  # a timeout, not a hang
    message = str(caught.value)
    assert "iteration 1 failed" in message and "no checkpoint exists yet" in message
    assert len(rl.history) == 1
