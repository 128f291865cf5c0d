"""Launching: with ``rollout.sglang.launch_command`` naming the fake server's module,
the backend starts it as SGLang's launcher would be started (SGLang's flags, a
random-init policy written as a checkpoint from the run's seed), the engine generates
with the same weights a torch engine of the run starts with, and closing the engine
stops the server and removes the checkpoint."""

import os
import tempfile
from pathlib import Path

import anyio
import httpx
import pytest

from dynarl.testing.ports import free_port
from dynarl.testing.sinks import RecordingSink
from dynarl.workers.config import RolloutConfig
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.rollout import Completion, GenerateRequest, RolloutEngine, SamplingParams
from dynarl.workers.sglang.backend import BACKEND
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.errors import LaunchFailedError
from dynarl.workers.torch.backend import BACKEND as TORCH

from .conftest import MODEL, cmdline

FAKE = ("python", "-m", "dynarl.testing.fake_sglang")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_a_launched_server_serves_the_runs_policy_and_stops_with_its_engine() -> None:
    port = free_port()
    sglang = SGLangConfig(launch_command=FAKE, port_base=port, startup_timeout_s=90)
    rollout = RolloutConfig(backend="sglang", max_running_requests=8, sglang=sglang)
    engine = BACKEND.build_rollout(
        RolloutRole(model=MODEL, rollout=rollout, seed=3), name="slot-0", num_threads=1
    )
    try:
        checkpoint = Path(engine.info.model_path or "")
        assert checkpoint.is_dir()
        assert engine.info.max_total_num_tokens == rollout.kv_capacity_tokens
        reference = TORCH.build_rollout(
            RolloutRole(model=MODEL, rollout=RolloutConfig(), seed=3), name="ref", num_threads=1
        )
        launched, expected = anyio.run(_greedy, engine), anyio.run(_greedy, reference)
        assert launched.output_ids == expected.output_ids
    finally:
        engine.close()
    assert not checkpoint.exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{engine.client.url}/health", timeout=2.0)
    ours = f"{FAKE[-1]} --model-path {checkpoint} "
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and ours in cmdline(pid)]
    assert not left, "a fake server outlived its engine"


async def _greedy(engine: RolloutEngine) -> Completion:
    sink = RecordingSink(raise_on_fail=True)
    request = GenerateRequest(request_id="g", prompt_ids=(5, 9, 11), sampling=GREEDY)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        await engine.submit([request], sink)
        await sink.wait_for(lambda: len(sink.completions) == 1)
        tg.cancel_scope.cancel()
    return sink.completions["g"]


def test_a_server_that_fails_to_start_is_a_clear_error_and_leaves_nothing() -> None:
    before = set(Path(tempfile.gettempdir()).glob("dynarl-sglang-policy-*"))
    sglang = SGLangConfig(
        launch_command=("python", "-c", "import sys; sys.exit(3)"), startup_timeout_s=30
    )
    role = RolloutRole(model=MODEL, rollout=RolloutConfig(backend="sglang", sglang=sglang))
    with pytest.raises(LaunchFailedError, match=r"exited with code 3.*log"):
        BACKEND.build_rollout(role, name="slot-0", num_threads=1)
    assert set(Path(tempfile.gettempdir()).glob("dynarl-sglang-policy-*")) == before
