"""``cluster.accelerator`` reaches what every backend builds: the trainers' config
(device and each worker's run device), the slots' roles, the torch engines, the torch
and Megatron inference workers and the trainer workers' world, which on a machine
without CUDA refuse ``cuda`` naming the field (CPU checks; the GPU runs are in
``test_accelerator_gpu.py``)."""

import importlib.util
import types

import pytest

torch = pytest.importorskip("torch")

from dynarl import ConfigError  # noqa: E402
from dynarl.api.config import DynaRLConfig  # noqa: E402
from dynarl.api.config_io import apply_overrides  # noqa: E402
from dynarl.api.world import RealWorld  # noqa: E402
from dynarl.core.ids import DeviceId  # noqa: E402
from dynarl.rl.grpo import GrpoLoss  # noqa: E402
from dynarl.workers import backends  # noqa: E402
from dynarl.workers.config import ActorConfig, ModelConfig  # noqa: E402
from dynarl.workers.protocol import InferenceRole, RolloutRole  # noqa: E402
from dynarl.workers.torch.device import torch_device  # noqa: E402
from dynarl.workers.torch.trainer_commands import Join  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402
from dynarl.workers.torch.trainer_world import join_world  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None


class _Worker:
    """A trainer worker as the pool names it (building a trainer calls none)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def call(self, body: bytes) -> bytes:
        raise AssertionError("building a trainer calls no worker")


def _trainer_backends() -> list[str]:
    return ["torch", "megatron"] if HAS_MEGATRON else ["torch"]


@pytest.mark.parametrize("name", _trainer_backends())
def test_the_trainer_config_carries_the_accelerator_and_each_workers_device(name: str) -> None:
    backend = backends.trainer_backend(ActorConfig(backend=name))
    trainer = backend.build_trainer(
        model=ModelConfig(),
        actor=ActorConfig(backend=name),
        loss=GrpoLoss(),
        seed=0,
        workers=[_Worker("trainer-0"), _Worker("trainer-1")],
        num_threads=1,
        accelerator="cuda",
        devices=[2, 3],
    )
    config: TrainerConfig = trainer.pool.config  # type: ignore[attr-defined]
    assert (config.device, config.device_ids) == ("cuda", (2, 3))
    default = backend.build_trainer(
        model=ModelConfig(),
        actor=ActorConfig(backend=name),
        loss=GrpoLoss(),
        seed=0,
        workers=[_Worker("trainer-0")],
        num_threads=1,
    )
    assert default.pool.config.device == "cpu"  # type: ignore[attr-defined]


def test_each_slot_role_carries_the_accelerator_and_its_own_device() -> None:
    cfg = apply_overrides(
        DynaRLConfig(), ["cluster.accelerator=cuda", "rollout.tp=2", "rollout.tail_tp=4"]
    )
    # The roles read only the configuration and the slots' devices.
    world = types.SimpleNamespace(cfg=cfg, slot_devices=[DeviceId(d) for d in range(8)])
    rollout = RealWorld.rollout_role(world, [DeviceId(2), DeviceId(5)])  # type: ignore[arg-type]
    inference = RealWorld.inference_role(world, DeviceId(3))  # type: ignore[arg-type]
    assert (rollout.accelerator, rollout.device, rollout.devices) == ("cuda", 2, (2, 5))
    assert rollout.engine_devices == (2, 5)
    assert rollout.server_index == 2  # the slot's server of rollout.tp
    wide = RealWorld.rollout_role(world, [DeviceId(d) for d in (4, 5, 6, 7)])  # type: ignore[arg-type]
    assert wide.server_index == 8 + 4  # the tail's: past every slot's
    assert (inference.accelerator, inference.device) == ("cuda", 3)


def test_a_cpu_device_is_the_cpu_whatever_its_number() -> None:
    assert torch_device("cpu", 5) == torch.device("cpu")


@NO_CUDA
def test_cuda_where_the_process_sees_none_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        torch_device("cuda", 0)
    assert caught.value.field == "cluster.accelerator"
    assert "set cluster.accelerator=cpu" in str(caught.value)


@NO_CUDA
@pytest.mark.parametrize("name", ["torch", "megatron"])
def test_a_slot_asked_for_cuda_without_cuda_refuses_before_building(name: str) -> None:
    if name == "megatron" and not HAS_MEGATRON:
        pytest.skip("megatron-core is not installed")
    role = InferenceRole(accelerator="cuda", device=1)
    cfg = apply_overrides(DynaRLConfig(), [f"inference.backend={name}"])
    backend = backends.inference_backend(cfg.inference)
    with pytest.raises(ConfigError, match=r"cluster\.accelerator=cuda"):
        backend.build_inference(role, name="slot-1", num_threads=1)


@NO_CUDA
def test_a_torch_rollout_engine_asked_for_cuda_without_cuda_refuses() -> None:
    backend = backends.rollout_backend(DynaRLConfig().rollout)
    with pytest.raises(ConfigError, match=r"cluster\.accelerator=cuda"):
        backend.build_rollout(RolloutRole(accelerator="cuda"), name="slot-0", num_threads=1)


def test_a_torch_rollout_engine_on_the_cpu_runs_there() -> None:
    backend = backends.rollout_backend(DynaRLConfig().rollout)
    engine = backend.build_rollout(RolloutRole(device=3), name="slot-3", num_threads=1)
    model = engine.engine.model  # type: ignore[attr-defined]
    assert next(model.parameters()).device == torch.device("cpu")


@NO_CUDA
def test_a_trainer_worker_asked_for_cuda_without_cuda_refuses_before_joining() -> None:
    command = Join(
        worker=1,
        num_workers=2,
        host="127.0.0.1",
        port=1,  # never dialled: the device is resolved first
        config=TrainerConfig(device="cuda", device_ids=(4, 5)),
        code=b"",
    )
    with pytest.raises(ConfigError, match=r"cluster\.accelerator=cuda"):
        join_world(command, store=None)
