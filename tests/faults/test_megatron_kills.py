"""A Megatron trainer rank killed (SIGKILL) in a real run (``actor.backend=megatron``,
tp = pp = 1, torch AdamW on the CPU): the trainer rebuilds itself from the surviving
rank, the interrupted step runs again on it, every sample is trained exactly once, the
reboot of the dead rank's device starts a new Megatron worker that the actor grows back
onto, and the run learns as the same run without the fault does. A tensor-parallel
run of one replica cannot survive the loss (the dead worker held the only copy of its
shard): it stops and says why."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL, TrainerRankLostError
from dynarl.testing.faults import FaultInjector, WorkerKill

from .rank_checks import assert_every_sample_trained_once, assert_rank_restarted_and_regrown

pytestmark = pytest.mark.slow

# The static split keeps the actor on its two devices, so the crashed one is rebooted
# into the actor at once.
JOB = [
    "actor.backend=megatron",
    "scheduler.mode=static-disaggregated",
    "run.checkpoint_every=0",
    "run.num_iterations=3",
    "cluster.num_devices=3",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "actor.initial_devices=2",
    "algorithm.old_logprobs=rollout",
    "algorithm.num_prompts=8",
]


def job(run_dir: Path) -> DynaRLConfig:
    return apply_overrides(DynaRLConfig(), [*JOB, f"run.run_dir={run_dir}"])


@pytest.mark.timeout(600)
async def test_a_killed_megatron_rank_is_survived_its_step_rerun_and_its_device_rejoins(
    tmp_path: Path,
) -> None:
    cfg = job(tmp_path / "killed")
    # The second rank, as the first optimizer step of iteration 1 starts.
    kill = WorkerKill(target="trainer", point="optimizer_step", iteration=1, index=1)
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, [kill])
        injector.attach()
        killed = await rl.run()
        record = assert_rank_restarted_and_regrown(rl, injector, ranks=2)
    assert record.iteration_done_s is not None  # the iteration it hit completed
    assert_every_sample_trained_once(injector, 3, cfg.algorithm.samples_per_iteration)
    assert sum(s.restarts.get("trainer", 0) for s in killed) == 1

    async with DynaRL(job(tmp_path / "fault_free")) as rl:
        fault_free = await rl.run()
    print(
        f"\nlosses {[s.loss for s in killed]} (killed) vs {[s.loss for s in fault_free]}; "
        f"rewards {[s.mean_reward for s in killed]} vs {[s.mean_reward for s in fault_free]}"
    )
    # Iterations 0 and 1 sample from the same weights; iteration 1's steps ran again
    # on one rank, which is the two ranks' maths to rounding.
    np.testing.assert_allclose(
        [s.loss for s in killed[:2]], [s.loss for s in fault_free[:2]], rtol=1e-4
    )
    assert [s.mean_reward for s in killed[:2]] == [s.mean_reward for s in fault_free[:2]]
    # Iteration 2 samples from weights equal to rounding (a near tie may flip a token).
    assert killed[2].mean_reward == pytest.approx(fault_free[2].mean_reward, abs=1e-2)


@pytest.mark.timeout(300)
async def test_a_tensor_parallel_megatron_run_that_loses_a_rank_stops_and_says_why(
    tmp_path: Path,
) -> None:
    cfg = apply_overrides(job(tmp_path / "run"), ["actor.tp=2", "run.num_iterations=1"])
    # The only replica's leader: its half of the model has no other copy.
    kill = WorkerKill(target="trainer", point="optimizer_step", iteration=0, index=0)
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, [kill])
        injector.attach()
        with pytest.raises(TrainerRankLostError) as stopped:
            await rl.run()
    assert len(injector.kills) == 1, "no trainer rank was killed"
    message = str(stopped.value)
    assert "tp=2, pp=1 cannot survive a lost worker" in message, message
    assert "start it again" in message, message  # no checkpoint yet: what to do next
