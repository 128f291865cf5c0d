"""The driver side of the elastic trainer: a pool of pre-started worker processes,
some of which are the trainer's data-parallel ranks at any moment.

The pool starts every worker once (spawn), joins them to one world process group, and
then only sends commands: train steps to the members, resizes to everyone. A resize
prepares the new group and the joiners' state while the old group stays intact, and
switches only when every worker reported ready; otherwise it aborts and raises
:class:`~dynarl.workers.torch.trainer_errors.ReshardError` with the old group in place.

This module does not import torch; the workers do.
"""

import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.workers.errors import ReshardError, TrainerError, WeightSyncError
from dynarl.workers.torch.trainer_commands import (
    AbortResize,
    Array,
    Command,
    CommitResize,
    ConnectWeightSync,
    Done,
    Failed,
    LeaveWeightSync,
    LoadCheckpoint,
    PrepareResize,
    Reply,
    ReshardFault,
    SaveCheckpoint,
    Shutdown,
    StartTraining,
    StepDone,
    SyncWeights,
    TrainStep,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.trainer import Minibatch, ResizeResult, StepMetrics

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 10.0


class TrainerPool:
    """An elastic data-parallel trainer over ``num_workers`` pre-started processes.

    Use as a context manager (or call :meth:`start` and :meth:`close`)::

        with TrainerPool(config, num_workers=4, model_factory=f, loss_fn=weighted_nll) as pool:
            pool.start_training([0])
            pool.train_step(minibatch)
            pool.resize([0, 1, 2, 3])

    ``model_factory`` and ``loss_fn`` must be picklable (module-level functions,
    ``functools.partial`` of classes and configs). Calls block; one at a time.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        num_workers: int,
        model_factory: Any,
        loss_fn: Any,
    ) -> None:
        if num_workers < 1:
            raise TrainerError(f"num_workers is {num_workers}; a pool needs at least 1 worker")
        self.config = config
        self.num_workers = num_workers
        self._model_factory = model_factory
        self._loss_fn = loss_fn
        self._members: tuple[int, ...] = ()
        self._parked = False
        self._epoch = 0
        self._processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._store_dir: Path | None = None
        self._sync_worker: int | None = None
        self._broken = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)

    @property
    def members(self) -> tuple[int, ...]:
        """Workers that are trainer ranks now, in data-parallel rank order (none while
        the trainer is parked)."""
        return () if self._parked else self._members

    @property
    def holder(self) -> int | None:
        """The worker holding the trainer's state: rank 0, or the parked state's keeper."""
        return self._members[0] if self._members else None

    @property
    def pids(self) -> list[int]:
        """Process ids of the started workers."""
        return [p.pid for p in self._processes if p.pid is not None]

    @property
    def parked(self) -> bool:
        """Whether the trainer holds no devices (see :meth:`park`)."""
        return self._parked

    def start(self) -> None:
        """Start the worker processes and wait until all joined the world group."""
        if self._processes:
            raise TrainerError("the pool is already started")
        context = multiprocessing.get_context("spawn")
        self._store_dir = Path(tempfile.mkdtemp(prefix="dynarl-trainer-"))
        store_path = str(self._store_dir / "store")
        for worker in range(self.num_workers):
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=_worker_entry,
                kwargs={
                    "worker": worker,
                    "num_workers": self.num_workers,
                    "store_path": store_path,
                    "config": self.config,
                    "model_factory": self._model_factory,
                    "loss_fn": self._loss_fn,
                    "conn": theirs,
                },
                name=f"dynarl-trainer-{worker}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(ours)
        self._check(self._gather(range(self.num_workers)))
        logger.info("started %d trainer workers", self.num_workers)

    def start_training(self, members: Sequence[int]) -> None:
        """Make ``members`` the trainer's ranks, with fresh weights from the seed (a
        trainer already running is dropped: this is also a restart)."""
        members = self._valid_members(members)
        self._check(self._call(range(self.num_workers), StartTraining(members=members)))
        self._members = members
        self._parked = False

    def train_step(self, minibatch: Minibatch) -> StepMetrics:
        """One optimizer step on the global ``minibatch``, split over the members."""
        if self._parked:
            raise TrainerError("the trainer is parked (it holds no devices); resize it first")
        arrays = {name: _to_array(a) for name, a in minibatch.items()}
        replies = self._check(self._call(self._members, TrainStep(minibatch=arrays)))
        assert isinstance(replies[0], StepDone)
        return replies[0].metrics

    def train_iteration(self, batch: Minibatch, n_minibatches: int) -> list[StepMetrics]:
        """``n_minibatches`` optimizer steps over ``batch`` cut into contiguous
        minibatches in order (resize between steps with :meth:`train_step`)."""
        num = len(next(iter(batch.values())))
        splits = np.array_split(np.arange(num), n_minibatches)
        return [
            self.train_step({k: v[s[0] : s[-1] + 1] for k, v in batch.items()})
            for s in splits
            if len(s)
        ]

    def resize(
        self,
        members: Sequence[int],
        *,
        source: int | None = None,
        fault: ReshardFault | None = None,
    ) -> ResizeResult:
        """Make ``members`` the trainer's ranks (create-before-destroy).

        Joiners receive parameters, buffers and AdamW state from ``source`` (default:
        the first current member that stays, else the first current member; from a
        parked trainer, its keeper). On any failure every worker drops what the resize
        prepared, the old members keep training (or the trainer stays parked), and
        :class:`ReshardError` is raised.
        """
        new = self._valid_members(members)
        if self._parked and new == self._members:
            self._parked = False  # the keeper becomes the only rank again: no transfer
            return ResizeResult(
                epoch=self._epoch, old_members=(), new_members=new, elapsed_s=0.0, bytes_moved=0
            )
        old = self._members
        if not old:
            raise TrainerError("the trainer has no members yet; call start_training first")
        if source is None:
            source = next((m for m in old if m in new), old[0])
        if source not in old:
            raise ReshardError(f"source worker {source} is not a member of {old}")
        self._epoch += 1
        started = time.perf_counter()
        prepare = PrepareResize(
            epoch=self._epoch, old_members=old, new_members=new, source=source, fault=fault
        )
        replies = self._call(range(self.num_workers), prepare)
        failures = [r for r in replies if isinstance(r, Failed)]
        if failures:
            self._check(self._call(range(self.num_workers), AbortResize(epoch=self._epoch)))
            raise ReshardError(
                f"resize {old} -> {new} failed and was rolled back; the old group keeps "
                f"training. {_describe(failures)}",
                worker=failures[0].worker,
            )
        self._check(self._call(range(self.num_workers), CommitResize(epoch=self._epoch)))
        self._members = new
        was_parked, self._parked = self._parked, False
        moved = sum(r.bytes_moved for r in replies if isinstance(r, Done) and r.worker == source)
        result = ResizeResult(
            epoch=self._epoch,
            old_members=() if was_parked else old,
            new_members=new,
            elapsed_s=time.perf_counter() - started,
            bytes_moved=moved,
        )
        logger.info("resized %s -> %s in %.3f s", old, new, result.elapsed_s)
        return result

    def park(self) -> ResizeResult:
        """Give up every device: the trainer's state stays with one worker (rank 0,
        which shrinks to a data-parallel group of one first) and no train step runs
        until :meth:`resize` gives it ranks again, with that worker as the source.

        A colocated schedule parks the trainer while the other stages hold the
        devices. On a CPU device the kept state stays where it is; a GPU backend
        would offload it to host memory here.
        """
        keeper = self.holder
        if keeper is None:
            raise TrainerError("the trainer has no members yet; call start_training first")
        result = self.resize([keeper]) if self._members != (keeper,) else None
        self._parked = True
        logger.info("parked the trainer on worker %d", keeper)
        return ResizeResult(
            epoch=self._epoch,
            old_members=() if result is None else result.old_members,
            new_members=(),
            elapsed_s=0.0 if result is None else result.elapsed_s,
            bytes_moved=0 if result is None else result.bytes_moved,
        )

    def save_checkpoint(self, path: str | Path) -> None:
        """Write rank 0's model and optimizer state to ``path`` (``torch.save``)."""
        self._check(self._call(self._members[:1], SaveCheckpoint(path=str(path))))

    def load_checkpoint(self, path: str | Path) -> None:
        """Make every member continue from the state :meth:`save_checkpoint` wrote to
        ``path`` (after :meth:`start_training`)."""
        if not self._members:
            raise TrainerError("the trainer has no members yet; call start_training first")
        self._check(self._call(self._members, LoadCheckpoint(path=str(path))))

    def connect_weight_sync(
        self, host: str, port: int, world_size: int, *, timeout_s: float | None = None
    ) -> None:
        """Make the trainer's rank 0 the sender (rank 0, store host at ``host:port``) of
        a weight-sync group of ``world_size``; the engines join it at the same time."""
        worker = self.holder
        if worker is None:
            raise WeightSyncError("the trainer has no members yet; call start_training first")
        command = ConnectWeightSync(
            host=host,
            port=port,
            world_size=world_size,
            timeout_s=timeout_s if timeout_s is not None else self.config.timeout_s,
        )
        self._check(self._call([worker], command))
        self._sync_worker = worker

    def leave_weight_sync(self) -> None:
        """The sender leaves the weight-sync group (collective: every engine of the
        group leaves at the same time); a no-op without a group."""
        if self._sync_worker is None:
            return
        worker, self._sync_worker = self._sync_worker, None
        self._check(self._call([worker], LeaveWeightSync()))

    @property
    def sync_sender(self) -> int | None:
        """The worker that sends in the weight-sync group (``None`` without a group)."""
        return self._sync_worker

    def sync_weights(self, version: int) -> int:
        """Broadcast the weights tagged ``version`` to the engines; returns bytes sent."""
        if self._sync_worker is None:
            raise WeightSyncError("no weight-sync group; call connect_weight_sync first")
        if self._sync_worker not in self._members:
            raise WeightSyncError(
                f"worker {self._sync_worker}, the sender of the weight-sync group, left the "
                "trainer; call connect_weight_sync again with the new rank 0"
            )
        reply = self._check(self._call([self._sync_worker], SyncWeights(version=version)))[0]
        assert isinstance(reply, Done)
        return reply.bytes_moved

    def close(self) -> None:
        """Shut the workers down (asking first, then terminating); idempotent."""
        alive = [w for w, p in enumerate(self._processes) if p.is_alive()]
        if alive and not self._broken:
            try:
                self._call(alive, Shutdown(), timeout_s=_SHUTDOWN_GRACE_S)
            except (TrainerError, OSError) as error:
                logger.warning("trainer workers did not shut down cleanly: %s", error)
        for process in self._processes:
            process.join(timeout=_SHUTDOWN_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(timeout=_SHUTDOWN_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._members = [], [], ()
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self) -> "TrainerPool":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _call(
        self, workers: Sequence[int] | range, command: Command, *, timeout_s: float | None = None
    ) -> list[Reply]:
        """Send ``command`` to ``workers`` and gather one reply from each."""
        if self._broken:
            raise TrainerError("the pool lost track of a worker; close it and start a new one")
        data = self._encoder.encode(command)
        for worker in workers:
            self._conns[worker].send_bytes(data)
        return self._gather(workers, timeout_s=timeout_s)

    def _gather(
        self, workers: Sequence[int] | range, *, timeout_s: float | None = None
    ) -> list[Reply]:
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        replies: dict[int, Reply] = {}
        waiting = set(workers)
        while waiting:
            conns = {self._conns[w]: w for w in waiting}
            sentinels = {self._processes[w].sentinel: w for w in waiting}
            ready = wait([*conns, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._broken = True
                raise TrainerError(f"trainer workers {sorted(waiting)} did not answer in time")
            for item in ready:
                if item in conns:
                    worker = conns[item]
                    replies[worker] = self._decoder.decode(self._conns[worker].recv_bytes())
                    waiting.discard(worker)
            for item in ready:
                if item in sentinels and sentinels[item] in waiting:
                    self._broken = True
                    worker = sentinels[item]
                    raise TrainerError(f"trainer worker {worker} died", worker=worker)
        return [replies[w] for w in workers]

    def _check(self, replies: list[Reply]) -> list[Reply]:
        failures = [r for r in replies if isinstance(r, Failed)]
        if failures:
            raise TrainerError(_describe(failures), worker=failures[0].worker)
        return replies

    def _valid_members(self, members: Sequence[int]) -> tuple[int, ...]:
        chosen = tuple(int(m) for m in members)
        if not chosen or len(set(chosen)) != len(chosen):
            raise TrainerError(f"members {chosen} must be a non-empty list of distinct workers")
        if any(not 0 <= m < self.num_workers for m in chosen):
            raise TrainerError(f"members {chosen} must be workers 0..{self.num_workers - 1}")
        return chosen


def _to_array(array: npt.NDArray[Any]) -> Array:
    contiguous = np.ascontiguousarray(array)
    return Array(dtype=str(contiguous.dtype), shape=contiguous.shape, data=contiguous.tobytes())


def _describe(failures: list[Failed]) -> str:
    return "; ".join(f"worker {f.worker}: {f.error}: {f.message}" for f in failures)


def _worker_entry(**kwargs: Any) -> None:
    """Spawn target; imports torch only in the child.

    After a clean shutdown the process leaves with ``os._exit``: tearing down an
    interpreter that imported torch and transformers takes seconds and frees nothing
    the OS would not. A worker that raised exits the normal way, with its traceback.
    """
    from dynarl.workers.torch.trainer_worker import worker_main

    worker_main(**kwargs)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
