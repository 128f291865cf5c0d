"""The DynaRL facade on real worker processes: a short run learns and writes its run
directory; leaving the context, by error or cancellation, leaves no process behind; it
runs inside an already-running loop (the test's own, like a notebook's); an iteration
that stops making progress stops the run."""

import multiprocessing
import os
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

pytest.importorskip("torch")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.api.stall import RunStalledError
from dynarl.core.ids import InstanceId
from dynarl.obs.metrics import read_metrics

pytestmark = pytest.mark.slow

FAST = [
    "scheduler.mode=static-disaggregated",
    "run.checkpoint_every=0",
]
# Two device slots (actor, rollout): the cheapest real pipeline to start.
SMALL = [
    *FAST,
    "cluster.num_devices=2",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "algorithm.old_logprobs=rollout",
    "algorithm.num_prompts=8",
]


def config(tmp_path: Path, *overrides: str) -> DynaRLConfig:
    return apply_overrides(DynaRLConfig(), [*overrides, f"run.run_dir={tmp_path / 'run'}"])


def worker_pids(rl: DynaRL) -> list[int]:
    world = rl._world
    assert world is not None
    assert world.trainer is not None
    slots = [h.pid for h in world.launcher.handles if h.pid is not None]
    trainers = [h.pid for h in world.trainer_workers if h.pid is not None]
    return slots + trainers


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(150)
async def test_a_short_run_learns_and_writes_its_run_directory(tmp_path: Path) -> None:
    cfg = config(tmp_path, *FAST, "run.num_iterations=4")
    async with DynaRL(cfg) as rl:
        history = await rl.run()
        graph = rl.controller.graph if rl.controller is not None else None
        assert rl._world is not None
        routed = rl._world.router.statistics()
    assert [s.iteration for s in history] == [0, 1, 2, 3]
    # The real workers report sizes: requests their prompt, samples prompt + response,
    # so the trainer's work (what the scheduler's model counts) is in tokens.
    assert graph is not None and graph.sized
    generated = sum(s.gen_tokens for s in history)
    samples = 4 * cfg.algorithm.num_prompts * cfg.algorithm.group_size
    assert graph.components["actor"].items_completed == samples
    # Every item went through the data router: each request, each sample to score,
    # each sample to train on (to the trainer rank whose shard holds it).
    assert routed.num_completed == 3 * samples
    assert graph.components["actor"].work_completed > generated + samples  # + prompts
    run_dir = tmp_path / "run"
    assert (run_dir / "config.yaml").is_file()
    assert read_metrics(run_dir / "metrics.jsonl") == history
    assert (run_dir / "checkpoints" / "iter_0004.pt").is_file()
    first, last = history[0], history[-1]
    assert last.mean_reward > first.mean_reward, [s.mean_reward for s in history]
    assert first.allocation == {"rollout": 2, "inference": 1, "actor": 1}
    assert first.device_s["rollout"] > 0 and first.migrations == []
    assert {"rollout", "score", "train", "sync"} <= set(first.stage_s)
    assert all(s.gen_tokens > 0 and s.tokens_per_s > 0 for s in history)


@pytest.mark.timeout(90)
async def test_an_error_inside_the_run_leaves_no_worker_process(tmp_path: Path) -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="user code failed"):
        async with DynaRL(config(tmp_path, *SMALL)) as rl:
            pids = worker_pids(rl)
            assert pids and all(alive(p) for p in pids)
            raise RuntimeError("user code failed")
    assert not [p for p in pids if alive(p)]
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(90)
async def test_runs_inside_a_running_loop_and_a_cancelled_iteration_stops_cleanly(
    tmp_path: Path,
) -> None:
    """The test's loop is already running, as a notebook's is; cancelling the caller
    mid-iteration shuts the run down with no process left."""
    cfg = config(tmp_path, *SMALL, "run.num_iterations=3")
    seen = []
    with anyio.move_on_after(60) as scope:
        async with DynaRL(cfg) as rl:
            pids = worker_pids(rl)
            async for stats in rl.iterations():
                seen.append(stats)
                # Cancel the next one midway (an iteration of this job takes ~0.3 s or more).
                scope.deadline = anyio.current_time() + 0.05
    assert scope.cancelled_caught
    assert len(seen) == 1 and seen[0].mean_reward >= 0.0
    assert not [p for p in pids if alive(p)]
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
async def test_a_kl_penalty_trains_on_the_reference_logprobs_inference_computes(
    tmp_path: Path,
) -> None:
    """The reference log-probs travel from the inference instances to the loss: with
    a KL term the loss reads them, so a run that dropped them could not take a step."""
    cfg = config(
        tmp_path,
        "run.checkpoint_every=0",
        "cluster.num_devices=3",
        "rollout.initial_devices=1",
        "inference.initial_devices=1",
        "scheduler.mode=static-disaggregated",
        "algorithm.num_prompts=8",
        "algorithm.kl_coef=0.5",
        "inference.compute_ref_logprobs=true",
        "run.num_iterations=2",
    )
    async with DynaRL(cfg) as rl:
        history = await rl.run()
    assert [s.iteration for s in history] == [0, 1]
    assert all(np.isfinite(s.loss) and s.grad_norm > 0 for s in history)


@pytest.mark.timeout(90)
async def test_an_iteration_that_stops_making_progress_stops_the_run_and_says_where(
    tmp_path: Path,
) -> None:
    # The router stops routing to the only rollout engine (as a move that failed to put
    # it back once did): the prompts wait in the router's backlog with nothing to take
    # them. The run stops after run.stall_timeout_s and says so, with the two views.
    cfg = config(tmp_path, *SMALL, "run.stall_timeout_s=2")
    with pytest.raises(RunStalledError) as caught:
        async with DynaRL(cfg) as rl:
            pids = worker_pids(rl)
            assert rl._world is not None
            rl._world.router.hold(InstanceId("rollout-0"))
            started = time.monotonic()
            await rl.step()
    waited = time.monotonic() - started
    message = str(caught.value)
    assert "iteration 0 made no progress for 2 s" in message, message
    assert "the run stops (no checkpoint exists yet: start it again)" in message, message
    assert (
        "rollout: active instances ['rollout-0']; the router routes to none "
        "(not to ['rollout-0'])" in message
    ), message
    prompts = cfg.algorithm.samples_per_iteration
    assert f"router: {prompts} items in its backlog" in message, message
    assert waited >= 2, waited  # it waited the timeout out
    assert not [p for p in pids if alive(p)]
