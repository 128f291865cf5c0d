"""The real world of a run: worker processes for the devices, and the handles that
reach them.

Device slots (one process each, from the :class:`~dynarl.launch.local.LocalLauncher`)
serve rollout and inference instances; trainer workers (one process each, in a
:class:`~dynarl.workers.torch.trainer_pool.TrainerPool`) are the actor's data-parallel
ranks. A device that only ever runs the actor gets no slot, and one that never runs
the actor gets no trainer worker: under ``static-disaggregated`` each device has one
process; otherwise every device has both, one of them holding memory at a time.

Torch is imported only by the trainer pool's and slots' processes, and by
:meth:`RealWorld.start` (for the model factory, lazily).
"""

import functools
import logging
from collections.abc import Sequence

import anyio

from dynarl.api.config import DynaRLConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT
from dynarl.core.ids import DeviceId, InstanceId
from dynarl.data.router import Router
from dynarl.launch.local import LaunchConfig, LocalLauncher
from dynarl.workers.handles import (
    InferenceHandle,
    RolloutHandle,
    SlotHandle,
    TrainerHandle,
    WorkerHandle,
)
from dynarl.workers.protocol import InferenceRole, RolloutRole
from dynarl.workers.slot import SlotConfig

logger = logging.getLogger(__name__)


class RealWorld:
    """Where a run's workers live, and their handles by instance.

    Args:
        cfg: the run's configuration.
        graph: the controller's hypergraph in its initial placement (read only).
        router: the data router the slots connect to (bound and running).
    """

    def __init__(self, cfg: DynaRLConfig, graph: Hypergraph, router: Router) -> None:
        self.cfg = cfg
        self.graph = graph
        self.router = router
        elastic = cfg.scheduler.mode != "static-disaggregated"
        actor_devices = {d for n in graph.components[ACTOR].instances.values() for d in n.devices}
        all_devices = [DeviceId(d) for d in range(cfg.cluster.num_devices)]
        self.slot_devices: list[DeviceId] = [
            d for d in all_devices if elastic or d not in actor_devices
        ]
        """Devices with a slot process, in slot order."""
        self.trainer_devices: list[DeviceId] = [
            d for d in all_devices if elastic or d in actor_devices
        ]
        """Devices with a trainer worker, in worker order."""
        self.launcher = LocalLauncher(
            router,
            LaunchConfig(
                num_slots=len(self.slot_devices),
                slot=SlotConfig(num_threads=cfg.cluster.threads_per_device),
            ),
        )
        self.rollout: dict[InstanceId, RolloutHandle] = {}
        """Rollout engines by instance."""
        self.inference: dict[InstanceId, InferenceHandle] = {}
        """Inference workers by instance."""
        self.trainer: TrainerHandle | None = None
        """The actor (after :meth:`start`)."""
        self.sync_engines: list[WorkerHandle] = []
        """The members of the weight-sync group (ranks 1..), in order."""

    @property
    def rollout_role(self) -> RolloutRole:
        """The role rollout slots assume."""
        return RolloutRole(model=self.cfg.model, rollout=self.cfg.rollout, seed=self.cfg.run.seed)

    @property
    def inference_role(self) -> InferenceRole:
        """The role inference slots assume."""
        return InferenceRole(
            model=self.cfg.model, inference=self.cfg.inference, seed=self.cfg.run.seed
        )

    def slot(self, device: DeviceId) -> SlotHandle:
        """The slot process of ``device``."""
        return self.launcher.slots[self.slot_devices.index(device)].handle

    def trainer_members(self, devices: Sequence[DeviceId]) -> list[int]:
        """The trainer workers of ``devices``."""
        return [self.trainer_devices.index(d) for d in devices]

    async def start(self) -> None:
        """Start the slots and the trainer pool, give every initial instance its role,
        start training and build the weight-sync group (version 0 is synced).

        On failure, what started is left for :meth:`aclose`.
        """
        from dynarl.rl.grpo import GrpoLoss
        from dynarl.workers.torch.model import build_model
        from dynarl.workers.torch.trainer_config import TrainerConfig
        from dynarl.workers.torch.trainer_pool import TrainerPool

        cfg = self.cfg
        trainer_cfg = TrainerConfig(
            micro_batch_size=cfg.actor.micro_batch_size,
            lr=cfg.actor.lr,
            weight_decay=cfg.actor.weight_decay,
            grad_clip=cfg.actor.grad_clip,
            seed=cfg.run.seed,
            num_threads=cfg.cluster.threads_per_device,
        )
        pool = TrainerPool(
            trainer_cfg,
            num_workers=len(self.trainer_devices),
            model_factory=functools.partial(build_model, cfg.model, seed=cfg.run.seed),
            loss_fn=GrpoLoss.from_config(cfg.algorithm),
        )
        self.trainer = TrainerHandle(pool)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.launcher.start)
            tg.start_soon(anyio.to_thread.run_sync, pool.start)
        actor = sorted(self.graph.components[ACTOR].active_instances(), key=lambda n: n.id)
        await self.trainer.start_training(
            self.trainer_members([d for n in actor for d in n.devices])
        )
        for node in sorted(self.graph.components[ROLLOUT].active_instances(), key=lambda n: n.id):
            slot = self.slot(node.devices[0])
            self.rollout[node.id] = await slot.assume_role(self.rollout_role, instance=node.id)
        for node in sorted(self.graph.components[INFERENCE].active_instances(), key=lambda n: n.id):
            slot = self.slot(node.devices[0])
            self.inference[node.id] = await slot.assume_role(self.inference_role, instance=node.id)
        # Engines receive weights only while they hold a role; a slot that changes
        # role (dynamic modes) needs the group rebuilt (see the executor).
        self.sync_engines = [s.handle for s in self.launcher.slots if s.handle.role is not None]
        await self.trainer.connect_weight_sync(self.sync_engines)
        await self.sync_weights(0)
        logger.info(
            "world started: %d slots, %d trainer workers",
            len(self.launcher.slots),
            len(self.trainer_devices),
        )

    async def sync_weights(self, version: int) -> int:
        """Broadcast the actor's weights as ``version`` to every slot; bytes sent."""
        assert self.trainer is not None, "start the world first"
        return await self.trainer.sync_weights(version, self.sync_engines)

    async def aclose(self) -> None:
        """Stop the trainer pool, then the slots; idempotent, and finishes even when
        the caller is cancelled (no process outlives it)."""
        with anyio.CancelScope(shield=True):
            if self.trainer is not None:
                pool, self.trainer = self.trainer.pool, None
                await anyio.to_thread.run_sync(pool.close)
            await self.launcher.aclose()
