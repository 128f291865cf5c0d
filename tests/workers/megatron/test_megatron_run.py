"""A run with the Megatron trainer resumes from its run directory: stopped after one
iteration and continued with ``dynarl run --resume``, it ends as an uninterrupted run
(rewards, losses, checkpointed weights)."""

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
