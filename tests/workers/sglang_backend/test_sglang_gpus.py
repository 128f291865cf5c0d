"""A launched server's GPUs: the engine's run devices, mapped as the torch backends
map theirs (run device ``d`` is GPU ``d % N`` of the ``N`` the slot's process sees),
given to the server as its ``CUDA_VISIBLE_DEVICES``, its ``--tp-size`` the number of
those devices. A slot that cannot see an engine's GPUs is refused naming the fix."""

from pathlib import Path

import pytest

from dynarl.core.errors import ConfigError
from dynarl.testing.ports import free_port
from dynarl.workers.config import RolloutConfig
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.sglang.backend import BACKEND
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.gpus import check_slot_gpus, server_env, server_gpus, visible_gpus

from .conftest import MODEL, cmdline

NODE = [str(i) for i in range(8)]


def test_an_engines_devices_are_the_gpus_of_the_same_number_on_its_node() -> None:
    assert server_gpus([2, 3], NODE) == ["2", "3"]
    assert server_gpus([0, 3], NODE) == ["0", "3"]  # a group need not be aligned
    assert server_gpus([9], NODE) == ["1"]  # run device 9 of a second node: GPU 1


def test_visible_devices_are_named_as_the_process_sees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, 6,GPU-7a")
    assert visible_gpus() == ["4", "5", "6", "GPU-7a"]
    assert server_env([1, 3], visible_gpus()) == {"CUDA_VISIBLE_DEVICES": "5,GPU-7a"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_an_engine_wider_than_the_gpus_its_slot_sees_is_refused_naming_the_fix() -> None:
    # Under Ray a slot's process sees its own bundle's GPU only.
    with pytest.raises(ConfigError) as caught:
        server_gpus([6, 7], ["3"])
    assert caught.value.field == "rollout.tp"
    assert "rollout.sglang.urls" in str(caught.value)
    assert server_gpus([6], ["3"]) == ["3"]


def test_engines_within_a_slots_bundle_are_accepted() -> None:
    # Wider ones are refused by check_backends (tests/workers/test_backends.py).
    check_slot_gpus({"rollout.tp": 2, "rollout.tail_tp": 4}, 4)  # bundles of 4 GPUs: fine


def test_a_slot_that_sees_no_gpu_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        server_gpus([0], [])
    assert caught.value.field == "cluster.accelerator"


@pytest.mark.slow
def test_a_launched_server_runs_on_its_engines_gpus_at_their_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    port = free_port()
    sglang = SGLangConfig(
        launch_command=("python", "-m", "dynarl.testing.fake_sglang"),
        port_base=port,
        startup_timeout_s=90,
    )
    rollout = RolloutConfig(backend="sglang", tp=2, sglang=sglang)
    role = RolloutRole(model=MODEL, rollout=rollout, accelerator="cuda", device=2, devices=(2, 5))
    engine = BACKEND.build_rollout(role, name="slot-0", num_threads=1)
    try:
        assert engine.info.tp_size == 2
        (server,) = [
            pid
            for pid in _pids()
            if "fake_sglang" in cmdline(pid)
            and f"--port {port} " in cmdline(pid)
            and "tether" not in cmdline(pid)
        ]
        env = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=2,5" in env
        assert "--tp-size 2 " in cmdline(server)
    finally:
        engine.close()


def _pids() -> list[str]:
    return [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
