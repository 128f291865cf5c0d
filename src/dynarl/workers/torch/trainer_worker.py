"""The trainer worker process: a pre-started device slot that can become a trainer rank.

It joins the world process group once (gloo on CPU, NCCL on GPU), then serves commands
from its pool over a pipe until told to shut down or the pipe closes: one msgpack
command in, one reply out, dispatched by a table keyed on the command type. A command
that raises is answered with :class:`~dynarl.workers.torch.trainer_commands.Failed`
and the worker keeps serving.
"""

import datetime
import logging
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError, WeightSyncError
from dynarl.workers.torch import reshard
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.train_batch import to_tensors
from dynarl.workers.torch.trainer import ElasticTrainer, ModelFactory
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    Command,
    CommitResize,
    ConnectWeightSync,
    Done,
    Failed,
    LeaveWeightSync,
    LoadCheckpoint,
    PrepareResize,
    Reply,
    SaveCheckpoint,
    Shutdown,
    StartTraining,
    StepDone,
    SyncWeights,
    TrainStep,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.weight_sync import (
    join_weight_sync_group,
    leave_weight_sync_group,
    send_weights,
)
from dynarl.workers.trainer import LossFn

logger = logging.getLogger(__name__)


def worker_main(
    *,
    worker: int,
    num_workers: int,
    store_path: str,
    config: TrainerConfig,
    model_factory: ModelFactory,
    loss_fn: LossFn,
    conn: Connection,
) -> None:
    """Process entry: join the world as rank ``worker``, answer ``Done`` when ready,
    then serve commands on ``conn``. Process groups are torn down however it exits."""
    torch.set_num_threads(config.num_threads)
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", worker % torch.cuda.device_count())
        torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{store_path}",
        rank=worker,
        world_size=num_workers,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    server = TrainerWorker(
        worker, config=config, model_factory=model_factory, loss_fn=loss_fn, device=device
    )
    try:
        conn.send_bytes(_ENCODER.encode(Done(worker=worker, elapsed_s=_since(started))))
        server.serve(conn)
    finally:
        server.close()
        dist.destroy_process_group()
        conn.close()


class TrainerWorker:
    """A worker's state between commands: its trainer (while it is a member), a
    prepared resize, and its weight-sync group."""

    def __init__(
        self,
        worker: int,
        *,
        config: TrainerConfig,
        model_factory: ModelFactory,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        self.worker = worker
        self.config = config
        self.model_factory = model_factory
        self.loss_fn = loss_fn
        self.device = device
        self.trainer: ElasticTrainer | None = None
        self.pending: reshard.PendingResize | None = None
        self.sync_group: Group | None = None
        self._handlers: dict[type, Callable[[Any], Reply]] = {
            StartTraining: self._start,
            TrainStep: self._train_step,
            PrepareResize: self._prepare,
            CommitResize: self._commit,
            AbortResize: self._abort,
            SaveCheckpoint: self._save,
            LoadCheckpoint: self._load,
            ConnectWeightSync: self._connect,
            SyncWeights: self._sync,
            LeaveWeightSync: self._leave,
            Shutdown: lambda _: self._done(time.perf_counter()),
        }

    def serve(self, conn: Connection) -> None:
        """Answer commands until ``Shutdown`` or until the pool closes the pipe."""
        while True:
            try:
                command = _DECODER.decode(conn.recv_bytes())
            except (EOFError, OSError):
                logger.warning("worker %d: the pool went away; exiting", self.worker)
                return
            try:
                reply = self._handlers[type(command)](command)
            except Exception as error:
                logger.exception("worker %d: %s failed", self.worker, type(command).__name__)
                reply = Failed(worker=self.worker, error=type(error).__name__, message=str(error))
            try:
                conn.send_bytes(_ENCODER.encode(reply))
            except OSError:
                logger.warning("worker %d: the pool went away; exiting", self.worker)
                return
            if isinstance(command, Shutdown):
                return

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
            list(command.members), timeout=datetime.timedelta(seconds=self.config.timeout_s)
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

    def _prepare(self, command: PrepareResize) -> Reply:
        started = time.perf_counter()
        if self.pending is not None:
            raise TrainerError(f"resize {self.pending.epoch} is still pending; abort it first")
        self.pending = reshard.create_groups(
            command, worker=self.worker, timeout_s=self.config.reshard_timeout_s
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

    def _connect(self, command: ConnectWeightSync) -> Reply:
        started = time.perf_counter()
        self.sync_group = join_weight_sync_group(
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
        sent = send_weights(
            trainer.model,
            version=command.version,
            group=self.sync_group,
            bucket_bytes=self.config.bucket_bytes,
            staging=trainer.staging,
        )
        return self._done(started, bytes_moved=sent)

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
