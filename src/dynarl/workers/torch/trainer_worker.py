"""The trainer worker process: a pre-started process on a device that can become a
trainer rank.

It is a peer of the controller's data router, as a device slot is: it says hello, then
serves its pool's commands as typed calls (one msgpack command in, one reply out,
dispatched by a table keyed on the command type), each run in a thread so the link
keeps answering pings. Its first command, ``Join``, makes it a rank of the world
process group (gloo on CPU, NCCL on GPU) with a TCP rendezvous at the store worker 0
opened before (``OpenStore``), so a launcher may place it on any node. A command that
raises is answered with :class:`~dynarl.workers.torch.trainer_commands.Failed` and the
worker keeps serving.
"""

import datetime
import logging
import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import torch
import torch.distributed as dist

from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import wire
from dynarl.data.endpoint import split_endpoint
from dynarl.data.errors import PeerLostError
from dynarl.data.worker_link import WorkerLink, open_worker_link
from dynarl.workers.errors import TrainerError, WeightSyncError
from dynarl.workers.torch import reshard
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.rendezvous import TCPStore, connect_store, open_store
from dynarl.workers.torch.train_batch import to_tensors
from dynarl.workers.torch.trainer import ElasticTrainer, ModelFactory
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    Command,
    CommitResize,
    ConnectWeightSync,
    DescribeWeights,
    Done,
    Failed,
    Join,
    LeaveWeightSync,
    LeaveWorld,
    Left,
    LoadCheckpoint,
    OpenStore,
    PrepareResize,
    Rejoin,
    Reply,
    Restore,
    SaveCheckpoint,
    Shutdown,
    StartTraining,
    StepDone,
    StoreOpened,
    SyncWeights,
    TrainOnItems,
    TrainStep,
    WeightsDescribed,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.weight_sync import (
    join_weight_sync_group,
    leave_weight_sync_group,
    manifest_of,
    send_by_manifest,
)
from dynarl.workers.trainer import Array, LossFn, StepMetrics
from dynarl.workers.trainer_items import stack_rows

logger = logging.getLogger(__name__)


ACTOR = ComponentId("actor")
"""The component trainer workers say hello as: the data router routes the actor's
samples to them (each to the rank whose shard holds it)."""

_CAPACITY = 1 << 20  # samples a worker may hold: a step's shard arrives before the step


Joiner = Callable[[Join, TCPStore | None], "TrainerWorker"]
"""Builds the worker from its ``Join`` command and the world store it opened (worker
0; ``None`` elsewhere), see :func:`join_world`."""


async def serve(endpoint: str, name: str, join: Joiner | None = None) -> None:
    """Serve the pool's commands as ``name`` until retired or cut off. ``join`` builds
    the worker from its ``Join`` command (default: this backend's; another trainer
    backend passes its own subclass of :class:`TrainerWorker`)."""
    join = join if join is not None else _join
    from dynarl.data.zmq_transport import ZmqTransport

    address, token = split_endpoint(endpoint)
    transport = ZmqTransport.connect(address)
    server: TrainerWorker | None = None
    world_store: TCPStore | None = None  # worker 0's, from OpenStore until Join
    inbox: dict[str, wire.Item] = {}  # samples routed here, until a step takes them
    try:
        async with open_worker_link(
            transport, instance=InstanceId(name), component=ACTOR, capacity=_CAPACITY, token=token
        ) as link:
            while True:
                try:
                    call = await link.receive_call()
                except PeerLostError as e:
                    logger.info("trainer worker %s: %s", name, e)
                    return
                command: Command | None = None
                try:
                    command = _DECODER.decode(call.body)
                    reply: Reply
                    if (
                        isinstance(command, OpenStore)
                        and command.purpose == "world"
                        and server is None
                    ):
                        world_store = open_store(
                            command.host, command.world_size, command.timeout_s
                        )
                        reply = StoreOpened(worker=command.worker, port=world_store.port)
                    elif isinstance(command, Join):
                        store, world_store = world_store, None  # the world group keeps it
                        server = await anyio.to_thread.run_sync(join, command, store)
                        reply = Done(worker=command.worker, elapsed_s=0.0)
                    elif server is None:
                        raise TrainerError(f"{name} got {type(command).__name__} before Join")
                    elif isinstance(command, TrainOnItems):
                        reply = await _train_on_items(server, link, inbox, command)
                    else:
                        reply = await anyio.to_thread.run_sync(server.handle, command)
                except Exception as error:
                    logger.exception("%s: %s failed", name, type(command).__name__)
                    worker = -1 if server is None else server.worker
                    reply = Failed(worker=worker, error=type(error).__name__, message=str(error))
                if isinstance(command, Shutdown) and server is not None:
                    # Leave the groups now; the process goes when the launcher
                    # retires it (so the router does not see it vanish).
                    done: TrainerWorker = server
                    server = None
                    await anyio.to_thread.run_sync(_leave, done)
                await link.reply(call.corr, _ENCODER.encode(reply))
    finally:
        if server is not None:
            _leave(server)
        await transport.aclose()


async def _train_on_items(
    server: "TrainerWorker", link: WorkerLink, inbox: dict[str, wire.Item], command: TrainOnItems
) -> Reply:
    """Wait until every sample of ``command`` has been routed here, train on them (or
    not: ``command.apply``), and complete them. A step that fails keeps them here: the
    survivors of a lost rank re-run it on them."""
    with anyio.fail_after(server.config.timeout_s):
        while any(i not in inbox for i in command.item_ids):
            for item in await link.receive():
                inbox[item.id] = item
    items = [inbox[i] for i in command.item_ids]
    reply: Reply = Done(worker=server.worker, elapsed_s=0.0)
    if command.apply:
        shard = stack_rows([item.payload for item in items])
        reply = await anyio.to_thread.run_sync(server.train_shard, shard)
    for item in items:
        del inbox[item.id]
        link.complete(wire.ItemResult(item=item.id))
    return reply


def _leave(server: "TrainerWorker") -> None:
    server.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(command: Join, store: TCPStore | None) -> "TrainerWorker":
    """Join the world group (blocks until every worker joined) and build the worker."""
    device, model_factory, loss_fn = join_world(command, store)
    return TrainerWorker(
        command.worker,
        config=command.config,
        model_factory=model_factory,
        loss_fn=loss_fn,
        device=device,
        world=tuple(range(command.num_workers)),
    )


def join_world(command: Join, store: TCPStore | None) -> tuple[torch.device, Any, Any]:
    """Join the trainer's world process group as ``command`` says, at ``store`` (worker
    0's, which it opened) or by connecting to ``command.host:port`` (blocks until every
    worker joined); returns this worker's device and the unpickled model factory and
    loss."""
    config = command.config
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", command.worker % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model_factory, loss_fn = pickle.loads(command.code)
    if store is None:
        store = connect_store(command.host, command.port, command.num_workers, config.timeout_s)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=command.worker,
        world_size=command.num_workers,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    return device, model_factory, loss_fn


class TrainerWorker:
    """A worker's state between commands: its trainer (while it is a member), a
    prepared resize, and its weight-sync group.

    ``worker`` is its index in the pool, for good; ``world`` lists the pool indices of
    the world process group's ranks (rank ``r`` is ``world[r]``): every worker at
    first, the survivors after a worker died (:class:`Rejoin`)."""

    def __init__(
        self,
        worker: int,
        *,
        config: TrainerConfig,
        model_factory: ModelFactory,
        loss_fn: LossFn,
        device: torch.device,
        world: tuple[int, ...] = (),
    ) -> None:
        self.worker = worker
        self.world = world
        self.world_store: TCPStore | None = None  # opened for the next Rejoin
        self.attempted = -1  # the step count the last step began from
        self.last_step: StepMetrics | None = None  # the last applied step's metrics
        self.config = config
        self.model_factory = model_factory
        self.loss_fn = loss_fn
        self.device = device
        self.trainer: ElasticTrainer | None = None
        self.pending: reshard.PendingResize | None = None
        self.sync_group: Group | None = None
        self.sync_store: TCPStore | None = None  # opened for the next ConnectWeightSync
        self._handlers: dict[type, Callable[[Any], Reply]] = {
            StartTraining: self._start,
            TrainStep: self._train_step,
            PrepareResize: self._prepare,
            CommitResize: self._commit,
            AbortResize: self._abort,
            SaveCheckpoint: self._save,
            LoadCheckpoint: self._load,
            ConnectWeightSync: self._connect,
            DescribeWeights: self._describe,
            SyncWeights: self._sync,
            LeaveWeightSync: self._leave,
            OpenStore: self._open_store,
            LeaveWorld: self._leave_world,
            Rejoin: self._rejoin,
            Restore: self._restore,
            Shutdown: lambda _: self._done(time.perf_counter()),
        }

    def handle(self, command: Command) -> Reply:
        """Carry out one command (blocking); a failure is answered with ``Failed``."""
        try:
            return self._handlers[type(command)](command)
        except Exception as error:
            logger.exception("worker %d: %s failed", self.worker, type(command).__name__)
            return Failed(worker=self.worker, error=type(error).__name__, message=str(error))

    def close(self) -> None:
        """Drop a prepared resize and the trainer (process groups go with the world)."""
        if self.pending is not None:
            reshard.abort_resize(self.pending)
        self.pending = None
        self.trainer = None
        self.sync_group = None

    def _start(self, command: StartTraining) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:
            raise TrainerError(f"resize {self.pending.epoch} is pending; abort it first")
        if self.trainer is not None:  # a restart: the previous trainer goes
            if self.trainer.group is not None:
                dist.destroy_process_group(self.trainer.group)
            reshard.release_memory(self.trainer)
            self.trainer = None
        group = dist.new_group(
            self.ranks(command.members),
            timeout=datetime.timedelta(seconds=self.config.timeout_s),
        )
        if self.worker in command.members:
            self.trainer = ElasticTrainer.build(
                self.model_factory,
                loss_fn=self.loss_fn,
                config=self.config,
                device=self.device,
                group=group,
            )
        return self._done(started)

    def _train_step(self, command: TrainStep) -> Reply:
        started = time.perf_counter()
        metrics = self._member().train_step(to_tensors(command.minibatch, self.device))
        return StepDone(worker=self.worker, metrics=metrics, elapsed_s=_since(started))

    def train_shard(self, shard: dict[str, Array]) -> Reply:
        """One optimizer step (with the other ranks) on this rank's own ``shard``."""
        started = time.perf_counter()
        tensors = to_tensors(shard, self.device) if shard else {}
        trainer = self._member()
        self.attempted = trainer.num_steps
        metrics = self.last_step = trainer.train_step(tensors, local=True)
        return StepDone(worker=self.worker, metrics=metrics, elapsed_s=_since(started))

    def _prepare(self, command: PrepareResize) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:
            raise TrainerError(f"resize {self.pending.epoch} is still pending; abort it first")
        self.pending = reshard.create_groups(
            command, worker=self.worker, ranks=self.ranks, timeout_s=self.config.reshard_timeout_s
        )
        moved = reshard.transfer_state(
            self.pending,
            command,
            worker=self.worker,
            trainer=self.trainer,
            make_skeleton=self._skeleton,
            device=self.device,
            bucket_bytes=self.config.bucket_bytes,
        )
        return self._done(started, bytes_moved=moved)

    def _commit(self, command: CommitResize) -> Reply:
        started = time.perf_counter()
        pending = self._pending(command.epoch)
        self.trainer = reshard.commit_resize(pending, worker=self.worker, trainer=self.trainer)
        self.pending = None
        return self._done(started)

    def _abort(self, command: AbortResize) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:  # absent when this worker failed creating groups
            reshard.abort_resize(self._pending(command.epoch))
            self.pending = None
        return self._done(started)

    def _save(self, command: SaveCheckpoint) -> Reply:
        started = time.perf_counter()
        # A crash mid-write leaves the previous checkpoint intact, never a torn file.
        tmp = f"{command.path}.tmp"
        torch.save(self._member().checkpoint(), tmp)
        os.replace(tmp, command.path)
        return self._done(started)

    def _load(self, command: LoadCheckpoint) -> Reply:
        started = time.perf_counter()
        trainer = self._member()
        try:
            # On the CPU: load_state_dict copies onto the model's device, and the RNG
            # state must stay a CPU tensor.
            state = torch.load(command.path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise TrainerError(f"cannot read the checkpoint {command.path}: {exc}") from exc
        trainer.load_checkpoint(state)
        return self._done(started)

    def _open_store(self, command: OpenStore) -> Reply:
        store = open_store(command.host, command.world_size, command.timeout_s)
        if command.purpose == "world":  # for a Rejoin (the first Join's is opened by serve)
            self.world_store = store
        else:
            self.sync_store = store
        return StoreOpened(worker=self.worker, port=store.port)

    def ranks(self, workers: Sequence[int]) -> list[int]:
        """The world ranks of pool workers ``workers``."""
        return [self.world.index(w) for w in workers]

    def _leave_world(self, command: LeaveWorld) -> Reply:
        if self.pending is not None:
            reshard.abort_resize(self.pending)
            self.pending = None
        trainer = self.trainer
        if trainer is not None:
            trainer.group = None  # destroyed with the world below
        if dist.is_initialized():
            dist.destroy_process_group()
        self.world = ()
        return Left(
            worker=self.worker,
            num_steps=-1 if trainer is None else trainer.num_steps,
            attempted=self.attempted,
            last=self.last_step,
        )

    def _rejoin(self, command: Rejoin) -> Reply:
        started = time.perf_counter()
        if dist.is_initialized():
            raise TrainerError(f"worker {self.worker} did not leave its world first")
        timeout_s = self.config.timeout_s
        store, self.world_store = self.world_store, None
        if store is None or store.port != command.port:
            store = connect_store(command.host, command.port, len(command.workers), timeout_s)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            store=store,
            rank=command.workers.index(self.worker),
            world_size=len(command.workers),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.world = command.workers
        return self._done(started)

    def _restore(self, command: Restore) -> Reply:
        started = time.perf_counter()
        members = list(command.members)
        group = dist.new_group(
            self.ranks(members), timeout=datetime.timedelta(seconds=self.config.timeout_s)
        )
        if self.worker not in members:
            if self.trainer is not None:
                reshard.release_memory(self.trainer)
            self.trainer = None
            return self._done(started)
        # torch numbers a group's ranks in world-rank order.
        src = sorted(self.ranks(members)).index(self.world.index(command.source))
        bucket_bytes = self.config.bucket_bytes
        if self.worker == command.source:
            moved = reshard.send_state(
                self._member(), group=group, src=src, bucket_bytes=bucket_bytes
            )
            self._member().group = group
            return self._done(started, bytes_moved=moved)
        if self.trainer is not None:
            reshard.release_memory(self.trainer)
        skeleton = self._skeleton()
        reshard.receive_state(skeleton, group=group, src=src, bucket_bytes=bucket_bytes)
        skeleton.group = group
        self.trainer = skeleton
        return self._done(started)

    def _connect(self, command: ConnectWeightSync) -> Reply:
        started = time.perf_counter()
        store, self.sync_store = self.sync_store, None
        self.sync_group = join_weight_sync_group(
            store=store if store is not None and store.port == command.port else None,
            host=command.host,
            port=command.port,
            rank=0,
            world_size=command.world_size,
            device=self.device,
            timeout_s=command.timeout_s,
        )
        return self._done(started)

    def _sync(self, command: SyncWeights) -> Reply:
        started = time.perf_counter()
        if self.sync_group is None:
            raise WeightSyncError(f"worker {self.worker} is not in a weight-sync group")
        trainer = self._member()
        manifest = manifest_of(
            trainer.model, version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        sent = send_by_manifest(
            trainer.model, manifest, group=self.sync_group, staging=trainer.staging
        )
        return self._done(started, bytes_moved=sent)

    def _describe(self, command: DescribeWeights) -> Reply:
        manifest = manifest_of(
            self._member().model, version=command.version, bucket_bytes=self.config.bucket_bytes
        )
        return WeightsDescribed(worker=self.worker, manifest=manifest)

    def _leave(self, command: LeaveWeightSync) -> Reply:
        started = time.perf_counter()
        if self.sync_group is not None:
            group, self.sync_group = self.sync_group, None
            leave_weight_sync_group(group)
        return self._done(started)

    def _skeleton(self) -> ElasticTrainer:
        return ElasticTrainer.skeleton(
            self.model_factory, loss_fn=self.loss_fn, config=self.config, device=self.device
        )

    def _member(self) -> ElasticTrainer:
        if self.trainer is None:
            raise TrainerError(f"worker {self.worker} is not a trainer rank now")
        return self.trainer

    def _pending(self, epoch: int) -> reshard.PendingResize:
        if self.pending is None or self.pending.epoch != epoch:
            have = None if self.pending is None else self.pending.epoch
            raise TrainerError(f"no prepared resize {epoch} on worker {self.worker} (have {have})")
        return self.pending

    def _done(self, started: float, *, bytes_moved: int = 0) -> Done:
        return Done(worker=self.worker, elapsed_s=_since(started), bytes_moved=bytes_moved)


def _since(started: float) -> float:
    return time.perf_counter() - started


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)
