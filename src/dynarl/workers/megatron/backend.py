"""The Megatron-core backend's entry in the backend table: the elastic trainer over
its worker processes (``actor.backend=megatron``) and a slot's log-prob inference
worker (``inference.backend=megatron``). Called in a worker thread."""

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from dynarl.core.config import Accelerator
from dynarl.envs.environment import ChatMessage
from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.config import ActorConfig, ModelConfig
from dynarl.workers.megatron.inference import MegatronInference
from dynarl.workers.megatron.main import megatron_trainer_main
from dynarl.workers.megatron.pool import MegatronPool
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.protocol import InferenceRole
from dynarl.workers.torch.device import torch_device
from dynarl.workers.torch.torch_trainer import TorchTrainer
from dynarl.workers.torch.trainer_calls import WorkerChannel
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.warm_start import warm_start
from dynarl.workers.trainer import LossFn

logger = logging.getLogger(__name__)


class MegatronBackend:
    """Builds the Megatron-core trainer and inference worker."""

    trainer_worker_entry: WorkerEntry = staticmethod(megatron_trainer_main)
    """The trainer workers' process main (the launcher starts them with it)."""

    def build_inference(
        self, role: InferenceRole, *, name: str, num_threads: int
    ) -> MegatronInference:
        """A log-prob worker running Megatron's forward for ``role``, on its device (the
        CPU, or its GPU)."""
        torch.set_num_threads(num_threads)
        device = torch_device(role.accelerator, role.device)
        return MegatronInference.from_config(
            role.model, role.inference, seed=role.seed, name=name, device=device
        )

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
        """An elastic (dp, tp, pp) trainer over ``workers`` (started by the launcher
        with :func:`megatron_trainer_main`), rendezvousing at worker 0's
        ``rendezvous_host``; worker ``i`` runs on ``accelerator``, as the run's device
        ``devices[i]`` (empty: ``i``)."""
        spec = ModelSpec(
            model=model,
            tp=actor.tp,
            pp=actor.pp,
            seed=seed,
            distributed_optimizer=actor.megatron.uses_distributed_optimizer(accelerator),
            buddy_copies=actor.megatron.buddy_copies,
        )
        spec.architecture()  # refuses a model or split it cannot build, before any start
        config = TrainerConfig.of_actor(
            actor, seed=seed, accelerator=accelerator, devices=devices, num_threads=num_threads
        )
        pool = MegatronPool(
            config, workers=workers, model_factory=spec, loss_fn=loss, host=rendezvous_host
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
        """Supervised steps of the random-init policy before the run, in this process,
        saved as an HF checkpoint (the torch backend's: the result is the same HF
        checkpoint that ``model.path`` then names for the megatron trainer)."""
        return warm_start(
            model, demonstrations, tools=tools, steps=steps, lr=lr, seed=seed, out_dir=out_dir
        )


BACKEND = MegatronBackend()
"""The Megatron backend (the backend table loads it by this name)."""
