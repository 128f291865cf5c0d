"""A trainer worker's place in the world process group, and how it survives a peer's
death: it leaves the broken world, joins the survivors' new one and restores one
consistent trainer state from the survivor the pool names.

The world group (gloo on CPU, NCCL on GPU) is what every other group of the trainer is
built on: the data-parallel group, a resize's groups, the groups of a restore. A worker
joins it first with ``Join`` (at the store worker 0 opened) and, after a peer died, again
with ``Rejoin`` (at a store the first survivor opened), with fresh ranks. Each leave
starts a new *generation*: work begun in an earlier world (a resize interrupted by the
leave, whose thread may still be blocked in gloo) must not install what it built.
"""

import datetime
import logging
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.torch import reshard
from dynarl.workers.torch.device import torch_device
from dynarl.workers.torch.rendezvous import TCPStore, connect_store
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_commands import Join, Rejoin, Restore

logger = logging.getLogger(__name__)


def join_world(command: Join, store: TCPStore | None) -> tuple[torch.device, Any, Any]:
    """Join the trainer's world process group as ``command`` says, at ``store`` (the
    world's first worker's, which it opened) or by connecting to ``command.host:port``
    (blocks until every worker of the world joined); returns this worker's device and
    the unpickled model factory and loss."""
    config = command.config
    ids = config.device_ids
    device = torch_device(config.device, ids[command.worker] if ids else command.worker)
    model_factory, loss_fn = pickle.loads(command.code)
    world = command.world
    if store is None:
        store = connect_store(command.host, command.port, len(world), config.timeout_s)
    dist.init_process_group(
        _backend(device),
        store=store,
        rank=world.index(command.worker),
        world_size=len(world),
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    return device, model_factory, loss_fn


class WorldGroup:
    """Worker ``worker``'s membership of the world process group.

    ``workers`` lists the pool indices of the world's ranks (rank ``r`` is
    ``workers[r]``): every worker at first, the survivors after a rejoin; empty while
    this worker is out of any world.
    """

    def __init__(
        self, worker: int, *, device: torch.device, timeout_s: float, workers: tuple[int, ...]
    ) -> None:
        self.worker = worker
        self.device = device
        self.timeout_s = timeout_s
        self.workers = workers
        self.generation = 0
        self.store: TCPStore | None = None  # opened for the next rejoin (first survivor)

    def ranks(self, workers: Sequence[int]) -> list[int]:
        """The world ranks of pool workers ``workers``."""
        return [self.workers.index(w) for w in workers]

    def leave(self) -> None:
        """Leave the world and every group built on it (a collective with a dead peer
        cannot complete); the trainer state stays in memory. Starts a new generation."""
        self.generation += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        self.workers = ()

    def rejoin(self, command: Rejoin) -> None:
        """Form the survivors' new world (blocks until every survivor joined)."""
        if dist.is_initialized():
            raise TrainerError(f"worker {self.worker} did not leave its world first")
        store, self.store = self.store, None
        if store is None or store.port != command.port:
            store = connect_store(command.host, command.port, len(command.workers), self.timeout_s)
        dist.init_process_group(
            _backend(self.device),
            store=store,
            rank=command.workers.index(self.worker),
            world_size=len(command.workers),
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self.workers = command.workers


def restore(
    command: Restore,
    *,
    world: WorldGroup,
    trainer: ElasticTrainer | None,
    make_skeleton: Callable[[], ElasticTrainer],
    bucket_bytes: int,
) -> tuple[ElasticTrainer | None, int]:
    """This worker's part of ``command`` in the new world (collective over it): build
    the members' data-parallel group; the source sends its whole state, the other
    members receive it into a fresh skeleton, a worker that is not a member releases
    its state. Without a source every member keeps its own state (they are the
    same): only the group is built. Returns this worker's trainer afterwards and the
    bytes it sent."""
    if command.holders:
        raise TrainerError(
            "a torch trainer rank holds the whole state; a restore from model shards "
            f"(holders {command.holders}) is for model-parallel ranks"
        )
    members = list(command.members)
    group = dist.new_group(
        world.ranks(members), timeout=datetime.timedelta(seconds=world.timeout_s)
    )
    if world.worker not in members:
        if trainer is not None:
            reshard.release_memory(trainer)
        return None, 0
    if command.source is None:
        if trainer is None:
            raise TrainerError(f"worker {world.worker}, a member, holds no state to keep")
        trainer.group = group
        return trainer, 0
    # torch numbers a group's ranks in world-rank order.
    src = sorted(world.ranks(members)).index(world.workers.index(command.source))
    if world.worker == command.source:
        if trainer is None:
            raise TrainerError(f"worker {world.worker}, the restore's source, holds no state")
        moved = reshard.send_state(trainer, group=group, src=src, bucket_bytes=bucket_bytes)
        trainer.group = group
        return trainer, moved
    if trainer is not None:
        reshard.release_memory(trainer)
    skeleton = make_skeleton()
    reshard.receive_state(skeleton, group=group, src=src, bucket_bytes=bucket_bytes)
    skeleton.group = group
    return skeleton, 0


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
