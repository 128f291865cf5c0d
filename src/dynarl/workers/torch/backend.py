"""The torch reference backend's entry in the backend table: it builds a slot's
rollout engine and inference worker, and the elastic trainer. Called in a worker
thread (building loads torch and a model)."""

import functools
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import torch

from dynarl.core.config import Accelerator
from dynarl.data.request_order import order_named
from dynarl.data.request_queue import RequestQueue
from dynarl.envs.environment import ChatMessage
from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.config import ActorConfig, ModelConfig
from dynarl.workers.protocol import InferenceRole, RolloutRole
from dynarl.workers.torch.device import torch_device
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.inference import InferenceWorker
from dynarl.workers.torch.inference_server import TorchInference
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.rollout_server import TorchRollout
from dynarl.workers.torch.sequence import Sequence as EngineSequence
from dynarl.workers.torch.torch_trainer import TorchTrainer
from dynarl.workers.torch.trainer_calls import WorkerChannel
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.trainer_main import trainer_main
from dynarl.workers.torch.trainer_pool import TrainerPool
from dynarl.workers.torch.warm_start import warm_start
from dynarl.workers.trainer import LossFn


class TorchBackend:
    """Builds the torch reference implementations of every role."""

    trainer_worker_entry: WorkerEntry = staticmethod(trainer_main)
    """The trainer workers' process main (the launcher starts them with it)."""

    def build_rollout(self, role: RolloutRole, *, name: str, num_threads: int) -> TorchRollout:
        """A rollout engine whose waiting queue is the data plane's request queue, on
        the role's device (the CPU, or its GPU)."""
        torch.set_num_threads(num_threads)
        device = torch_device(role.accelerator, role.device)
        order = order_named(role.order)
        queue = RequestQueue[EngineSequence](
            order, max_size=role.max_queued_requests, clock=_MonotonicClock(), aging=role.aging
        )
        engine = RolloutEngine.from_config(
            role.model, role.rollout, seed=role.seed, device=device, queue=queue
        )
        return TorchRollout(engine, name=name)

    def build_inference(
        self, role: InferenceRole, *, name: str, num_threads: int
    ) -> TorchInference:
        """An inference worker for ``role``, on its device (the CPU, or its GPU)."""
        torch.set_num_threads(num_threads)
        device = torch_device(role.accelerator, role.device)
        worker = InferenceWorker.from_config(
            role.model, role.inference, seed=role.seed, device=device
        )
        return TorchInference(worker, name=name)

    def build_trainer(
        self,
        *,
        model: ModelConfig,
        actor: ActorConfig,
        loss: LossFn,
        seed: int,
        workers: Sequence[WorkerChannel],
        num_threads: int,
        rendezvous_host: str = "127.0.0.1",
        accelerator: Accelerator = "cpu",
        devices: Sequence[int] = (),
    ) -> TorchTrainer:
        """An elastic data-parallel trainer over ``workers`` (started by the launcher
        with :func:`trainer_main`; not joined yet), rendezvousing at worker 0's
        ``rendezvous_host``; worker ``i`` runs on ``accelerator``, as the run's device
        ``devices[i]`` (empty: ``i``)."""
        config = TrainerConfig.of_actor(
            actor, seed=seed, accelerator=accelerator, devices=devices, num_threads=num_threads
        )
        pool = TrainerPool(
            config,
            workers=workers,
            model_factory=functools.partial(build_model, model, seed=seed),
            loss_fn=loss,
            host=rendezvous_host,
        )
        return TorchTrainer(pool)

    def warm_start(
        self,
        model: ModelConfig,
        demonstrations: Sequence[Sequence[ChatMessage]],
        *,
        tools: Sequence[dict[str, object]],
        steps: int,
        lr: float,
        seed: int,
        out_dir: Path,
    ) -> list[float]:
        """Supervised steps of the random-init policy on ``demonstrations``, saved to
        ``out_dir`` (see :mod:`dynarl.workers.torch.warm_start`)."""
        return warm_start(
            model, demonstrations, tools=tools, steps=steps, lr=lr, seed=seed, out_dir=out_dir
        )


class _MonotonicClock:
    """Wall-clock time for the engine's queue (the engine's own clock): the queue is
    read from the stepping thread, where the event loop's clock is not available."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


BACKEND = TorchBackend()
"""The torch backend (the backend table loads it by this name)."""
