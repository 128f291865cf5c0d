"""Runs with the Megatron backends: one resumes from its run directory (stopped after
one iteration and continued with ``dynarl run --resume``, it ends as an uninterrupted
run: rewards, losses, checkpointed weights), and a dynamic-mode run learns as the torch
backends do (the same reward curve while devices move between the stages)."""

import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynarl.api.config import DynaRLConfig  # noqa: E402
from dynarl.api.config_io import apply_overrides  # noqa: E402
from dynarl.api.facade import DynaRL  # noqa: E402
from dynarl.obs.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = [
    "actor.backend=megatron",
    "scheduler.mode=static-disaggregated",
    "run.checkpoint_every=0",
    "cluster.num_devices=2",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "algorithm.old_logprobs=rollout",
    "algorithm.num_prompts=8",
]


def config(run_dir: Path, *overrides: str) -> DynaRLConfig:
    return apply_overrides(DynaRLConfig(), [*SMALL, *overrides, f"run.run_dir={run_dir}"])


@pytest.mark.timeout(300)
async def test_a_resumed_megatron_run_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    async with DynaRL(config(tmp_path / "whole", "run.num_iterations=2")) as rl:
        whole = await rl.run()
    part = tmp_path / "part"
    async with DynaRL(config(part, "run.num_iterations=1")) as rl:
        await rl.run()
    command = [sys.executable, "-m", "dynarl.cli", "run", "--resume", str(part)]
    result = await anyio.run_process([*command, "--set", "run.num_iterations=2"], check=False)
    assert result.returncode == 0, result.stderr.decode()[-2000:]

    resumed = read_metrics(part / "metrics.jsonl")
    assert [s.iteration for s in resumed] == [0, 1]
    assert [s.mean_reward for s in resumed] == [s.mean_reward for s in whole]
    np.testing.assert_allclose([s.loss for s in resumed], [s.loss for s in whole], rtol=1e-5)
    ours = torch.load(part / "checkpoints" / "iter_0002.pt", weights_only=True)
    theirs = torch.load(tmp_path / "whole" / "checkpoints" / "iter_0002.pt", weights_only=True)
    assert ours["format"] == "dynarl-megatron-hf-1"
    for name, value in theirs["model"].items():
        torch.testing.assert_close(ours["model"][name], value, rtol=1e-5, atol=1e-7, msg=name)


DYNAMIC = [
    "scheduler.mode=dynamic",
    "cluster.num_devices=3",
    "inference.initial_devices=1",
    "algorithm.old_logprobs=inference",
    "run.num_iterations=2",
]


@pytest.mark.timeout(300)
async def test_a_dynamic_megatron_run_has_the_torch_backends_reward_curve(
    tmp_path: Path,
) -> None:
    backends = {
        name: [f"actor.backend={name}", f"inference.backend={name}"]
        for name in ("torch", "megatron")
    }
    curves = {}
    for name, overrides in backends.items():
        async with DynaRL(config(tmp_path / name, *DYNAMIC, *overrides)) as rl:
            curves[name] = await rl.run()
    torch_run, megatron_run = curves["torch"], curves["megatron"]
    # The Megatron trainer resized its data-parallel group while the run moved devices,
    # and the Megatron inference worker computed the old log-probs.
    moves = [m for s in megatron_run for m in s.migrations if m.kind == "reshard"]
    assert any(m.dst == "actor" for m in moves)
    assert all(s.device_s["inference"] > 0 for s in megatron_run)
    # The first iteration samples from the same initial weights: the same responses, so
    # the same loss and gradient norm to rounding.
    first, theirs = megatron_run[0], torch_run[0]
    assert first.gen_tokens == theirs.gen_tokens
    assert first.loss == pytest.approx(theirs.loss, rel=1e-4)
    assert first.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    # Later iterations sample from weights equal to rounding; a near tie may flip a
    # sampled token, which moves the mean reward by a few 1e-3 at most.
    np.testing.assert_allclose(
        [s.mean_reward for s in megatron_run], [s.mean_reward for s in torch_run], atol=1e-2
    )
