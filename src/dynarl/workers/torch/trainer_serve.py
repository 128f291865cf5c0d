"""The trainer worker process's command loop.

The process is a peer of the controller's data router, as a device slot is: it says
hello, then serves its pool's commands as typed calls (one msgpack command in, one
reply out), each run in a thread so the link keeps answering pings. Its first command,
``Join``, makes it a rank of the world process group (gloo on CPU, NCCL on GPU) with a
TCP rendezvous at the store the world's first worker opened before (``OpenStore``), so
a launcher may place it on any node (a worker restarted after its process died joins
the world the others rebuild for it). A command that raises is answered with
:class:`~dynarl.workers.torch.trainer_commands.Failed` and the worker keeps serving.

Commands run one at a time, in arrival order, but the loop keeps receiving while one
runs: the pool sends a worker a new command while the last one still runs only after it
gave up on that one because a peer died. ``LeaveWorld`` then *interrupts* it: it is
answered ``Failed`` (``Interrupted``) at once and its thread, which may be blocked in
gloo with the dead peer (a ``new_group`` waits for it up to several times the group's
timeout), is abandoned; it cannot install what it built (see
:class:`~dynarl.workers.torch.trainer_world.WorldGroup`'s generations). Only a resize's
(or a Megatron reshard's) prepare and a ``Rejoin`` (its rendezvous waits for every worker
of the new world, and a restarted worker may die before it gets there) are interrupted
so, and a train step of a worker whose ``steps_interruptible`` says so: a torch rank's
step ends at once when a peer dies (gloo reports the closed connection to every rank:
each collective spans the dead one) and must not be abandoned halfway through its
optimizer update; a Megatron worker of a tensor- or pipeline-parallel replica may wait
in a collective of its replica that the dead worker is not in (until the group's
timeout), and applies its update only in the world the step began in. Any other
command waits for the running one.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
import torch.distributed as dist
from anyio.abc import TaskGroup

from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import wire
from dynarl.data.endpoint import split_endpoint
from dynarl.data.errors import PeerLostError
from dynarl.data.worker_link import WorkerLink, open_worker_link
from dynarl.workers.errors import TrainerError
from dynarl.workers.torch.rendezvous import TCPStore, open_store
from dynarl.workers.torch.trainer_commands import (
    Command,
    Done,
    Failed,
    Join,
    LeaveWorld,
    OpenStore,
    PrepareReshard,
    PrepareResize,
    Rejoin,
    Reply,
    Shutdown,
    StoreOpened,
    TrainOnItems,
    TrainStep,
)
from dynarl.workers.torch.trainer_worker import TrainerWorker
from dynarl.workers.torch.trainer_world import join_world
from dynarl.workers.trainer_items import stack_rows

logger = logging.getLogger(__name__)

T = TypeVar("T")

ACTOR = ComponentId("actor")
"""The component trainer workers say hello as: the data router routes the actor's
samples to them (each to the rank whose shard holds it)."""

_CAPACITY = 1 << 20  # samples a worker may hold: a step's shard arrives before the step

Joiner = Callable[[Join, TCPStore | None], TrainerWorker]
"""Builds the worker from its ``Join`` command and the world store it opened (worker
0; ``None`` elsewhere), see :func:`~dynarl.workers.torch.trainer_world.join_world`."""


async def serve(endpoint: str, name: str, join: Joiner | None = None) -> None:
    """Serve the pool's commands as ``name`` until retired or cut off. ``join`` builds
    the worker from its ``Join`` command (default: this backend's; another trainer
    backend passes its own subclass of :class:`TrainerWorker`)."""
    from dynarl.data.zmq_transport import ZmqTransport

    address, token = split_endpoint(endpoint)
    transport = ZmqTransport.connect(address)
    loop: _CommandLoop | None = None
    try:
        async with (
            open_worker_link(
                transport,
                instance=InstanceId(name),
                component=ACTOR,
                capacity=_CAPACITY,
                token=token,
            ) as link,
            anyio.create_task_group() as tg,
        ):
            loop = _CommandLoop(name, link, join if join is not None else _join)
            while True:
                try:
                    call = await link.receive_call()
                except PeerLostError as e:
                    logger.info("trainer worker %s: %s", name, e)
                    tg.cancel_scope.cancel()
                    return
                await loop.accept(call, tg)
    finally:
        if loop is not None and loop.server is not None:
            _leave(loop.server)
        await transport.aclose()


@dataclass
class _Running:
    """The command running now: its scope (cancelled to interrupt it) and its end."""

    command: Command
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


class _CommandLoop:
    """One worker process's commands: what it built and the command running now."""

    def __init__(self, name: str, link: WorkerLink, join: Joiner) -> None:
        self.name = name
        self.link = link
        self.join = join
        self.server: TrainerWorker | None = None
        self.world_store: TCPStore | None = None  # worker 0's, from OpenStore until Join
        self.inbox: dict[str, wire.Item] = {}  # samples routed here, until a step takes them
        self._running: _Running | None = None

    async def accept(self, call: wire.Call, tg: TaskGroup) -> None:
        """Start ``call``'s command once the running one ended (interrupting it for a
        ``LeaveWorld``)."""
        try:
            command = _DECODER.decode(call.body)
        except msgspec.DecodeError as error:
            await self._reply(call, self._failed(error))
            return
        running = self._running
        if running is not None:
            if isinstance(command, LeaveWorld) and self._interruptible(running.command):
                logger.warning(
                    "%s: %s interrupted to leave the world (a peer died)",
                    self.name,
                    type(running.command).__name__,
                )
                running.scope.cancel()
            await running.done.wait()
        self._running = _Running(command)
        tg.start_soon(self._run, call, self._running)

    def _interruptible(self, command: Command) -> bool:
        if isinstance(command, _INTERRUPTIBLE):
            return True
        steps = self.server is not None and self.server.steps_interruptible
        return steps and isinstance(command, (TrainStep, TrainOnItems))

    async def _run(self, call: wire.Call, running: _Running) -> None:
        try:
            reply: Reply | None = None
            with running.scope:
                reply = await self._execute(running.command)
            if reply is None:
                reply = Failed(
                    worker=-1 if self.server is None else self.server.worker,
                    error="Interrupted",
                    message=f"{type(running.command).__name__} was interrupted: a peer "
                    "died and the pool rebuilds the world",
                )
            await self._reply(call, reply)
        finally:
            running.done.set()
            if self._running is running:
                self._running = None

    async def _execute(self, command: Command) -> Reply:
        server = self.server
        try:
            if isinstance(command, OpenStore) and command.purpose == "world" and server is None:
                self.world_store = open_store(command.host, command.world_size, command.timeout_s)
                return StoreOpened(worker=command.worker, port=self.world_store.port)
            if isinstance(command, Join):
                store, self.world_store = self.world_store, None  # the world group keeps it
                self.server = await _in_thread(self.join, command, store)
                self.server.world.workers = command.world  # a restarted worker's: not all
                return Done(worker=command.worker, elapsed_s=0.0)
            if server is None:
                raise TrainerError(f"{self.name} got {type(command).__name__} before Join")
            if isinstance(command, TrainOnItems):
                return await _train_on_items(server, self.link, self.inbox, command)
            reply = await _in_thread(server.handle, command)
        except Exception as error:
            logger.exception("%s: %s failed", self.name, type(command).__name__)
            return self._failed(error)
        if isinstance(command, Shutdown):
            # Leave the groups now; the process goes when the launcher retires it
            # (so the router does not see it vanish).
            self.server = None
            await anyio.to_thread.run_sync(_leave, server)
        return reply

    def _failed(self, error: Exception) -> Failed:
        worker = -1 if self.server is None else self.server.worker
        return Failed(worker=worker, error=type(error).__name__, message=str(error))

    async def _reply(self, call: wire.Call, reply: Reply) -> None:
        with anyio.CancelScope(shield=True):
            await self.link.reply(call.corr, _ENCODER.encode(reply))


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; an interrupt abandons the thread (see the
    module)."""
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def _train_on_items(
    server: TrainerWorker, link: WorkerLink, inbox: dict[str, wire.Item], command: TrainOnItems
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
        reply = await _in_thread(server.train_shard, shard)
    for item in items:
        del inbox[item.id]
        link.complete(wire.ItemResult(item=item.id))
    return reply


def _leave(server: TrainerWorker) -> None:
    server.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(command: Join, store: TCPStore | None) -> TrainerWorker:
    """Join the world group (blocks until every worker joined) and build the worker."""
    device, model_factory, loss_fn = join_world(command, store)
    return TrainerWorker(
        command.worker,
        config=command.config,
        model_factory=model_factory,
        loss_fn=loss_fn,
        device=device,
    )


_INTERRUPTIBLE = (PrepareResize, PrepareReshard, Rejoin)
"""Commands that ``LeaveWorld`` interrupts (see the module)."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)
