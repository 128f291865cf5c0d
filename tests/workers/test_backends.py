"""The backend table honours the config: a backend that cannot run here is refused
with the field and the fix, never replaced by another."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynarl import ConfigError
from dynarl.api.assembly import check_backends
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.workers import backends

# Launched SGLang servers under Ray on one-GPU bundles, in the mode that regroups.
RAY_SGLANG = (
    "rollout.backend=sglang\n"
    "rollout.sglang.launch_command=[python, -m, dynarl.testing.fake_sglang]\n"
    "cluster.launcher=ray\ncluster.accelerator=cuda\ncluster.ray.gpus_per_device=1\n"
    "scheduler.mode=dynamic\n"
)


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        (
            "rollout.backend=sglang",
            "rollout.sglang.urls",
            ["pip install 'dynarl[sglang]'", "rollout.sglang.urls"],
        ),
        (
            "inference.backend=megatron\ninference.tp=2",
            "inference.tp",
            ["does not shard", "inference.tp=1"],
        ),
        ("rollout.tp=2", "rollout.tp", ["does not shard", "rollout.tp=1"]),
        ("rollout.tail_tp=2", "rollout.tail_tp", ["1 device", "rollout.backend=sglang"]),
        (
            "rollout.backend=sglang\nrollout.tail_tp=2\nrollout.sglang.urls=[http://h:1]",
            "rollout.tail_tp",
            ["servers it launches", "rollout.sglang.urls empty"],
        ),
        (RAY_SGLANG + "rollout.tp=2", "rollout.tp", ["set rollout.tp=", "local launcher"]),
        (
            RAY_SGLANG + "rollout.tail_tp=2",
            "rollout.tail_tp",
            ["set rollout.tail_tp=", "local launcher"],
        ),
        ("actor.tp=2", "actor.tp", ["actor.backend=megatron"]),
        ("actor.pp=2", "actor.pp", ["pipeline parallelism"]),
    ],
)
def test_a_backend_that_cannot_run_here_is_refused_naming_the_field_and_the_fix(
    override: str, field: str, says: list[str]
) -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            *override.split("\n"),
            "rollout.initial_devices=2",
            "actor.initial_devices=2",
            "inference.initial_devices=0",
        ],
    )
    with pytest.raises(ConfigError) as info:
        check_backends(cfg)
    assert info.value.field == field
    for text in says:
        assert text in str(info.value)


@pytest.mark.parametrize("role", ["inference", "actor"])
def test_megatron_is_refused_naming_its_extra_where_megatron_core_is_missing(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "_installed", lambda module: module != "megatron.core")
    cfg = apply_overrides(DynaRLConfig(), [f"{role}.backend=megatron"])
    with pytest.raises(ConfigError, match=r"pip install 'dynarl\[megatron\]'") as info:
        check_backends(cfg)
    assert info.value.field == f"{role}.backend"


def test_megatron_shards_the_actor_over_devices() -> None:
    pytest.importorskip("megatron.core")
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            "actor.backend=megatron",
            "actor.tp=2",
            "actor.pp=2",
            "actor.initial_devices=4",
            "cluster.num_devices=8",
        ],
    )
    check_backends(cfg)


def test_the_default_backends_run_here() -> None:
    check_backends(DynaRLConfig())
    assert backends.preload_modules(DynaRLConfig().rollout) == ("torch", "transformers")


_PRELOAD = """
import sys
import anyio
from dynarl.workers.slot import SlotConfig, SlotServer
config = SlotConfig(preload_modules={modules!r}, import_warnings={warnings!r})
anyio.run(SlotServer("slot-0", config).preload)
assert "megatron.core.optimizer" in sys.modules
"""


def test_a_slot_preloading_megatron_does_not_warn_about_absent_fused_kernels() -> None:
    """megatron-core warns when it loads that Transformer Engine and Apex are absent
    (four times a process); a slot that preloads it for the Megatron backends says
    nothing of it, and still shows other warnings."""
    pytest.importorskip("megatron.core")
    cfg = apply_overrides(DynaRLConfig(), ["inference.backend=megatron"])
    modules = backends.preload_modules(cfg.rollout, cfg.inference)
    assert "megatron.core" in modules
    script = _PRELOAD.format(
        modules=modules, warnings=backends.import_warnings(cfg.rollout, cfg.inference)
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "are not installed" not in out.stderr
    bare = subprocess.run(
        [sys.executable, "-c", _PRELOAD.format(modules=modules, warnings=())],
        check=False,
        capture_output=True,
        text=True,
    )
    assert bare.stderr.count("Transformer Engine and Apex are not installed") == 4


def test_a_missing_package_is_named_before_the_backend_is_imported(monkeypatch) -> None:
    """A built backend whose package is absent names its extra (torch's here)."""
    monkeypatch.setattr(backends, "_installed", lambda module: module != "transformers")
    with pytest.raises(ConfigError, match=r"needs transformers.*dynarl\[torch\]"):
        backends.rollout_backend(DynaRLConfig().rollout)


def test_dynarl_run_with_an_unavailable_backend_fails_fast_with_the_extra(tmp_path: Path) -> None:
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynarl.cli",
            "run",
            "--set",
            "rollout.backend=sglang",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    elapsed = time.perf_counter() - started
    assert out.returncode == 2, out.stdout + out.stderr
    assert "rollout.backend='sglang'" in out.stderr
    assert "pip install 'dynarl[sglang]'" in out.stderr
    assert elapsed < 30  # a hang guard only (measured: 0.2 s)
    assert not (tmp_path / "run").exists(), "nothing is written for a refused run"


def test_megatron_trainer_settings_are_refused_for_another_trainer() -> None:
    with pytest.raises(ConfigError, match=r"actor\.backend=megatron") as info:
        apply_overrides(DynaRLConfig(), ["actor.megatron.distributed_optimizer=true"])
    assert info.value.field == "actor.megatron"
    chosen = apply_overrides(
        DynaRLConfig(), ["actor.backend=megatron", "actor.megatron.distributed_optimizer=true"]
    )
    assert chosen.actor.megatron.distributed_optimizer


def test_the_distributed_optimizer_follows_the_accelerator_unless_set() -> None:
    unset = apply_overrides(DynaRLConfig(), ["actor.backend=megatron"]).actor.megatron
    assert unset.distributed_optimizer is None
    assert unset.uses_distributed_optimizer("cuda")
    assert not unset.uses_distributed_optimizer("cpu")
    off = apply_overrides(
        DynaRLConfig(), ["actor.backend=megatron", "actor.megatron.distributed_optimizer=false"]
    ).actor.megatron
    assert not off.uses_distributed_optimizer("cuda")
