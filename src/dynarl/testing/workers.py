"""Worker processes of one role on this machine behind a data router of their own, for
tests and benchmarks that drive a trainer (or any workers reached by calls) without a
whole run: real processes, real ZeroMQ, real torch.distributed.

::

    async with LocalWorkers(backend.trainer_worker_entry, ["trainer-0", "trainer-1"]) as w:
        pool = TrainerPool(config, workers=w.channels, model_factory=f, loss_fn=loss)

:func:`train_through` takes one optimizer step the way a run does, the samples going
through the workers' router.

The router and the launcher live in a host task of their own
(:class:`~dynarl.api.host.RunHost`), so the workers may be started in one task and
stopped in another (a module-scoped test fixture).
"""

import contextlib
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from dynarl.api.host import RunHost
from dynarl.core.ids import ComponentId, EdgeId, GroupId, ItemId
from dynarl.data import RouterConfig
from dynarl.data.router import Router
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.local import LaunchConfig, LocalLauncher
from dynarl.workers.backend_protocols import WorkerEntry
from dynarl.workers.handles import CallChannel, SlotHandle
from dynarl.workers.trainer import Minibatch, StepMetrics, Trainer
from dynarl.workers.trainer_items import shard_items


class LocalWorkers:
    """``names`` worker processes running ``entry``; ``async with`` it.

    Args:
        entry: the workers' process main (e.g. a backend's ``trainer_worker_entry``).
        names: one worker per name.
        num_threads: torch threads per worker.
        liveness_timeout_s: how long a silent worker counts as alive.
        consumers: the components that consume each edge (items routed to the
            workers: e.g. ``{to_actor: [actor]}`` for trainer workers).
    """

    def __init__(
        self,
        entry: WorkerEntry,
        names: Sequence[str],
        *,
        num_threads: int = 1,
        liveness_timeout_s: float = 60.0,
        consumers: Mapping[EdgeId, Sequence[ComponentId]] | None = None,
    ) -> None:
        self.entry = entry
        self.names = list(names)
        self.num_threads = num_threads
        self.liveness_timeout_s = liveness_timeout_s
        self.consumers = dict(consumers or {})
        self.router: Router | None = None
        """The workers' data router (once started)."""
        self.channels: list[CallChannel] = []
        """One per worker, in order (once started)."""
        self.handles: list[SlotHandle] = []
        """The workers' process handles (pid, liveness), in order."""
        self._host = RunHost()
        self._launcher: LocalLauncher | None = None

    async def __aenter__(self) -> Self:
        await self._host.start(self._open)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._host.stop()

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        folder = Path(tempfile.mkdtemp(prefix="dynarl-workers-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        transport = ZmqTransport.bind(f"ipc://{folder}/router.sock")
        stack.push_async_callback(transport.aclose)
        config = RouterConfig(heartbeat_interval_s=0.5, liveness_timeout_s=self.liveness_timeout_s)
        router = await stack.enter_async_context(
            Router(transport, consumers=self.consumers, config=config)
        )
        self.router = router
        launcher = await stack.enter_async_context(LocalLauncher(router, LaunchConfig(num_slots=0)))
        self.handles = await launcher.start_workers(
            self.entry, self.names, num_threads=self.num_threads
        )
        self.channels = [CallChannel(router, name) for name in self.names]
        self._launcher = launcher

    async def restart(self, index: int) -> SlotHandle:
        """Start worker ``index`` again after its process died (a new process under
        its name, as the reboot of its device does) and wait for its hello; returns
        its new handle (also in :attr:`handles`)."""
        if self._launcher is None:
            raise RuntimeError("start the workers first: `async with LocalWorkers(...)`")
        handle = await self._launcher.restart_worker(self.names[index])
        self.handles[index] = handle
        return handle


async def train_through(
    router: Router, trainer: Trainer, minibatch: Minibatch, *, name: str, edge: EdgeId
) -> StepMetrics:
    """One optimizer step on ``minibatch`` as a run takes it: its samples (items
    ``{name}-{i}`` on ``edge``) go through ``router`` to the trainer's ranks, which train
    on them and hand them back (received here)."""
    num = len(next(iter(minibatch.values())))
    ids = [ItemId(f"{name}-{i}") for i in range(num)]
    groups = [GroupId(name)] * num
    items, shards = shard_items(minibatch, ids, groups, trainer.rank_instances(), edge=edge)
    await router.submit(items)
    metrics = await trainer.train_step(shards)
    back = 0
    while back < num:
        back += len(await router.receive_batch())
    return metrics
