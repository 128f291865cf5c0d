"""``cluster.accelerator``: what a device is. Every combination with the launcher, the
Ray bundles and the SGLang weight sync either works or is refused naming the field,
and ``cuda`` where this machine has no CUDA is refused before any worker starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from dynarl import ConfigError
from dynarl.api.assembly import check_backends
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides


def config(*overrides: str) -> DynaRLConfig:
    return apply_overrides(DynaRLConfig(), list(overrides))


def refusal(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        config(*overrides)
    return caught.value


def _has_cuda() -> bool:
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


def test_the_devices_are_cpu_slots_unless_told_otherwise() -> None:
    assert DynaRLConfig().cluster.accelerator == "cpu"
    assert config("cluster.accelerator=cuda").cluster.accelerator == "cuda"
    error = refusal("cluster.accelerator=tpu")
    assert "cluster.accelerator" in str(error)


def test_cuda_on_ray_needs_a_gpu_in_each_bundle() -> None:
    error = refusal("cluster.launcher=ray", "cluster.accelerator=cuda")
    assert error.field == "cluster.ray.gpus_per_device"
    assert "cluster.ray.gpus_per_device=1" in str(error)
    cfg = config(
        "cluster.launcher=ray", "cluster.accelerator=cuda", "cluster.ray.gpus_per_device=1"
    )
    assert cfg.cluster.ray.gpus_per_device == 1.0


def test_gpus_reserved_for_cpu_workers_are_refused_unless_sglang_servers_use_them() -> None:
    error = refusal("cluster.launcher=ray", "cluster.ray.gpus_per_device=1")
    assert error.field == "cluster.accelerator"
    assert "cluster.accelerator=cuda" in str(error)
    # Launched SGLang servers run on the GPUs their slot's bundle holds.
    cfg = config("cluster.launcher=ray", "cluster.ray.gpus_per_device=1", "rollout.backend=sglang")
    assert cfg.cluster.accelerator == "cpu"


@pytest.mark.parametrize(
    ("accelerator", "chosen"), [("cpu", "nccl"), ("cuda", "gloo")], ids=["cpu-nccl", "cuda-gloo"]
)
def test_an_sglang_weight_sync_backend_the_trainer_does_not_speak_is_refused(
    accelerator: str, chosen: str
) -> None:
    error = refusal(
        "rollout.backend=sglang",
        f"cluster.accelerator={accelerator}",
        f"rollout.sglang.weight_sync_backend={chosen}",
    )
    assert error.field == "rollout.sglang.weight_sync_backend"
    assert "leave rollout.sglang.weight_sync_backend unset" in str(error)


@pytest.mark.parametrize(("accelerator", "wanted"), [("cpu", "gloo"), ("cuda", "nccl")])
def test_the_sglang_weight_sync_follows_the_accelerator(accelerator: str, wanted: str) -> None:
    cfg = config("rollout.backend=sglang", f"cluster.accelerator={accelerator}")
    assert cfg.rollout.sglang.weight_sync_backend is None
    assert cfg.rollout.sglang.sync_backend(cfg.cluster.accelerator) == wanted
    agreeing = config(
        "rollout.backend=sglang",
        f"cluster.accelerator={accelerator}",
        f"rollout.sglang.weight_sync_backend={wanted}",
    )
    assert agreeing.rollout.sglang.sync_backend(agreeing.cluster.accelerator) == wanted


def test_cuda_is_refused_before_any_start_where_this_machine_has_none() -> None:
    if _has_cuda():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as caught:
        check_backends(config("cluster.accelerator=cuda"))
    assert caught.value.field == "cluster.accelerator"
    assert "set cluster.accelerator=cpu" in str(caught.value)
    check_backends(config())  # the CPU needs nothing


def test_dynarl_run_with_cuda_and_no_gpu_fails_fast_naming_the_field(tmp_path: Path) -> None:
    if _has_cuda():
        pytest.skip("this machine has CUDA")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynarl.cli",
            "run",
            "--set",
            "cluster.accelerator=cuda",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cluster.accelerator=cuda" in out.stderr
    assert not (tmp_path / "run").exists(), "nothing is written for a refused run"
