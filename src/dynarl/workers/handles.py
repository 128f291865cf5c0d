"""Typed handles: the controller's side of a worker process, one method per call.

``await handle.generate(requests)`` sends a :class:`~dynarl.workers.protocol.Generate`
through the data router to the handle's instance and returns the completions; there
are no method-name strings anywhere. A failed call raises
:class:`~dynarl.workers.errors.WorkerCallError` with the worker's error; a worker that
goes away mid-call raises :class:`~dynarl.data.errors.PeerLostError`.

- :class:`SlotHandle`: a device slot process, whatever role it holds; it assumes
  roles, which gives a role handle.
- :class:`RolloutHandle`: a rollout engine (generate, stream, abort, weight updates).
- :class:`InferenceHandle`: an inference worker (score samples).
- :class:`TrainerHandle`: the elastic trainer's process pool, awaitable, and weight
  sync from it to engines.

No torch is imported here.
"""

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
import msgspec

from dynarl.core.ids import InstanceId
from dynarl.data.calls import Call
from dynarl.data.errors import RoutingError
from dynarl.data.router import Router
from dynarl.workers import protocol as p
from dynarl.workers.errors import LaunchError, WorkerCallError
from dynarl.workers.inference import LogprobRequest, LogprobResult
from dynarl.workers.lifecycle import LifecycleState
from dynarl.workers.rollout import Completion, GenerateRequest

if TYPE_CHECKING:
    from dynarl.workers.torch.trainer_pool import TrainerPool
    from dynarl.workers.trainer import Minibatch, ResizeResult, StepMetrics

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=p.SlotReply)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(p.AnySlotReply)


def _decode(body: bytes, expected: type[R]) -> R:
    reply = _DECODER.decode(body)
    if isinstance(reply, p.Failed):
        raise WorkerCallError(reply.message, error=reply.error)
    if not isinstance(reply, expected):
        raise WorkerCallError(
            f"expected a {expected.__name__} reply, got {type(reply).__name__}",
            error="ProtocolError",
        )
    return reply


class WorkerHandle:
    """Calls every worker process answers, addressed to one instance.

    Args:
        router: the data router the worker is connected to.
        instance: the instance the worker runs.
    """

    def __init__(self, router: Router, instance: InstanceId) -> None:
        self._router = router
        self.instance = instance
        self.state: LifecycleState = "ready"
        """The lifecycle state the worker last reported."""

    async def _call(self, request: p.SlotRequest, expected: type[R]) -> R:
        body = await self._router.call(self.instance, _ENCODER.encode(request))
        reply = _decode(body, expected)
        if isinstance(reply, p.Ack | p.SlotStats):
            self.state = reply.state
        return reply

    async def stats(self) -> p.SlotStats:
        """The worker's state, role, weight version and load."""
        return await self._call(p.GetStats(), p.SlotStats)

    async def release_memory(self, *, host_backup: bool = False) -> LifecycleState:
        """Free the role's device memory, keeping the process (state ``released``);
        without ``host_backup`` the weights must be updated after resuming."""
        return (await self._call(p.ReleaseMemory(host_backup=host_backup), p.Ack)).state

    async def resume_memory(self) -> LifecycleState:
        """Allocate the released memory again (state ``active``)."""
        return (await self._call(p.ResumeMemory(), p.Ack)).state

    async def drain(self) -> LifecycleState:
        """Take no new work (state ``draining``); what it holds continues."""
        return (await self._call(p.Drain(), p.Ack)).state

    async def reactivate(self) -> LifecycleState:
        """Take new work again after :meth:`drain` (state ``active``)."""
        return (await self._call(p.Reactivate(), p.Ack)).state

    async def join_weight_sync(
        self, *, host: str, port: int, rank: int, world_size: int, timeout_s: float = 120.0
    ) -> None:
        """Join the trainer's weight-sync group as ``rank`` (see
        :meth:`TrainerHandle.connect_weight_sync`, which calls this)."""
        request = p.JoinWeightSync(
            host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s
        )
        await self._call(request, p.Ack)

    async def leave_weight_sync(self) -> None:
        """Leave the weight-sync group (see :meth:`TrainerHandle.connect_weight_sync`,
        which calls this on every member at once)."""
        await self._call(p.LeaveWeightSync(), p.Ack)

    async def update_weights(self) -> int:
        """Receive the weights the trainer broadcasts now; returns their version.
        Running requests continue under the new weights (re-prefilled)."""
        return (await self._call(p.UpdateWeights(), p.WeightsUpdated)).version


class RolloutHandle(WorkerHandle):
    """A rollout engine in a worker process."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate ``requests`` (fresh, or resumed with partial output) and return
        their completions in finishing order. Requests taken out by :meth:`abort`
        meanwhile are missing (the abort returned them)."""
        async with self.stream(requests) as completions:
            return [c async for c in completions]

    @contextlib.asynccontextmanager
    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator["Completions"]:
        """Generate ``requests``, yielding an iterator of completions as they finish::

            async with handle.stream(requests) as completions:
                async for completion in completions:
                    ...

        Leaving the block early aborts the requests not yet finished.
        """
        ids = [r.request_id for r in requests]
        body = _ENCODER.encode(p.Generate(requests=tuple(requests)))
        async with self._router.open_call(self.instance, body) as call:
            completions = Completions(call)
            try:
                yield completions
            finally:
                if not call.done:
                    left = [i for i in ids if i not in completions.finished]
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await self.abort(left)

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[GenerateRequest]:
        """Take requests out of the engine (all when ``None``; unknown or finished ids
        are ignored) and return each with its partial output and sampling seed, ready to
        :meth:`generate` on any engine."""
        ids = None if request_ids is None else tuple(request_ids)
        return list((await self._call(p.AbortRequests(request_ids=ids), p.Aborted)).requests)


class Completions:
    """The completions of one :meth:`RolloutHandle.stream` call, as they arrive."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._ready: list[Completion] = []
        self.finished: set[str] = set()
        """Ids of the requests whose completion arrived."""

    def __aiter__(self) -> "Completions":
        return self

    async def __anext__(self) -> Completion:
        while not self._ready:
            try:
                body = await self._call.receive()
            except anyio.EndOfStream:
                raise StopAsyncIteration from None
            self._ready.extend(reversed(_decode(body, p.Generated).completions))
        completion = self._ready.pop()
        self.finished.add(completion.request_id)
        return completion


class InferenceHandle(WorkerHandle):
    """An inference worker in a worker process."""

    async def score(self, requests: Sequence[LogprobRequest]) -> list[LogprobResult]:
        """Log-probs of ``requests``' response tokens, in order."""
        reply = await self._call(p.Score(requests=tuple(requests)), p.Scored)
        return list(reply.results)


class SlotHandle(WorkerHandle):
    """A device slot process, whatever role it holds.

    Args:
        router: the data router the slot is connected to.
        name: the slot's name (its instance id until its first role).
        pid: its process id, when known.
        alive: tells whether its process still runs (to fail fast while waiting).
    """

    def __init__(
        self,
        router: Router,
        name: str,
        *,
        pid: int | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(router, InstanceId(name))
        self.name = name
        self.pid = pid
        self.role: p.RoleKind | None = None
        """The role it holds."""
        self._next: InstanceId | None = None
        self._alive = alive or (lambda: True)

    @overload
    async def assume_role(
        self, role: p.RolloutRole, *, instance: InstanceId, timeout_s: float = ...
    ) -> RolloutHandle: ...

    @overload
    async def assume_role(
        self, role: p.InferenceRole, *, instance: InstanceId, timeout_s: float = ...
    ) -> InferenceHandle: ...

    async def assume_role(
        self, role: p.Role, *, instance: InstanceId, timeout_s: float = 120.0
    ) -> RolloutHandle | InferenceHandle:
        """Make the slot serve ``role`` as ``instance`` and return its role handle:
        :meth:`build_role`, then :meth:`connect_role`."""
        await self.build_role(role, instance=instance)
        return await self.connect_role(timeout_s=timeout_s)

    async def build_role(self, role: p.Role, *, instance: InstanceId) -> None:
        """First half of :meth:`assume_role`: the router stops routing to the slot's
        current instance and takes back what it held there; the slot releases the
        memory of its current role (keeping a host copy) and builds the new one, or
        resumes it if it held it before with the same configuration. The process stays.

        Until :meth:`connect_role`, the slot is still reached (by calls, never by
        items) as its old instance: the moment to bring its weights up to date. If the
        slot refuses (it still holds requests of its handles), the old instance is
        routed to again and :class:`WorkerCallError` is raised.
        """
        old = self.instance
        await self._router.drain(old)
        try:
            await self._call(p.AssumeRole(role=role, instance=instance), p.Ack)
        except BaseException:
            with contextlib.suppress(RoutingError):
                self._router.reactivate(old)
            raise
        self.role = "rollout" if isinstance(role, p.RolloutRole) else "inference"
        self._next = instance

    async def connect_role(self, *, timeout_s: float = 120.0) -> RolloutHandle | InferenceHandle:
        """Second half of :meth:`assume_role`: the slot reconnects as the instance
        :meth:`build_role` named, and its role handle is returned."""
        instance = self._next
        if instance is None or self.role is None:
            raise LaunchError(f"slot {self.name} has no role built to connect; build_role first")
        self._next = None
        await self._router.retire(self.instance, reason=f"{self.name} becomes {instance}")
        self.instance = instance
        await self.wait_connected(timeout_s)
        if self.role == "rollout":
            return RolloutHandle(self._router, instance)
        return InferenceHandle(self._router, instance)

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait until the slot has said hello as its current instance.

        Raises :class:`LaunchError` if its process exits or ``timeout_s`` passes first.
        """
        with anyio.move_on_after(timeout_s):
            while True:
                with anyio.move_on_after(0.2):
                    await self._router.wait_for_instance(self.instance)
                    return
                if not self._alive():
                    raise LaunchError(
                        f"slot {self.name} (pid {self.pid}) exited before it connected as "
                        f"{self.instance}; see its log output"
                    )
        raise LaunchError(
            f"slot {self.name} did not connect as {self.instance} within {timeout_s} s"
        )


class TrainerHandle:
    """The elastic trainer's process pool behind awaitable calls (run in a thread, one
    at a time), and weight sync from its rank 0 to engines.

    Args:
        pool: a started :class:`~dynarl.workers.torch.trainer_pool.TrainerPool`.
    """

    def __init__(self, pool: "TrainerPool") -> None:
        self.pool = pool
        self._lock = anyio.Lock()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with self._lock:
            return await anyio.to_thread.run_sync(fn, *args)

    async def start_training(self, members: Sequence[int]) -> None:
        """See :meth:`TrainerPool.start_training`."""
        await self._run(self.pool.start_training, members)

    async def train_step(self, minibatch: "Minibatch") -> "StepMetrics":
        """See :meth:`TrainerPool.train_step`."""
        metrics: StepMetrics = await self._run(self.pool.train_step, minibatch)
        return metrics

    async def resize(self, members: Sequence[int]) -> "ResizeResult":
        """See :meth:`TrainerPool.resize`."""
        result: ResizeResult = await self._run(self.pool.resize, members)
        return result

    async def park(self) -> "ResizeResult":
        """See :meth:`TrainerPool.park`."""
        result: ResizeResult = await self._run(self.pool.park)
        return result

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator["TrainerPool"]:
        """Hold the trainer between two optimizer steps (no step, resize or sync runs
        meanwhile); yields the pool for blocking calls made in a worker thread."""
        async with self._lock:
            yield self.pool

    async def connect_weight_sync(
        self,
        engines: Sequence[WorkerHandle],
        *,
        leaving: Sequence[WorkerHandle] = (),
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
    ) -> None:
        """Build the weight-sync group: the trainer's rank 0 (group rank 0, hosting the
        store on a free port of ``host``) and ``engines`` (ranks 1.., in order).

        ``leaving`` are the engines of the current group, if there is one: they and the
        current sender leave it together first (a collective, so no member tears the
        group down under a peer).
        """
        port = _free_port(host)
        world_size = len(engines) + 1

        async def join(engine: WorkerHandle, rank: int) -> None:
            await engine.join_weight_sync(
                host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s
            )

        async with self._lock:
            if self.pool.sync_sender is not None:
                async with anyio.create_task_group() as tg:
                    for engine in leaving:
                        tg.start_soon(engine.leave_weight_sync)
                    await anyio.to_thread.run_sync(self.pool.leave_weight_sync)
            async with anyio.create_task_group() as tg:
                for rank, engine in enumerate(engines, start=1):
                    tg.start_soon(join, engine, rank)
                await anyio.to_thread.run_sync(
                    lambda: self.pool.connect_weight_sync(
                        host, port, world_size, timeout_s=timeout_s
                    )
                )

    async def sync_weights(self, version: int, engines: Sequence[WorkerHandle]) -> int:
        """Broadcast the trainer's weights tagged ``version`` to ``engines`` (every
        member of the weight-sync group); returns the bytes sent."""
        versions: list[int] = []

        async def receive(engine: WorkerHandle) -> None:
            versions.append(await engine.update_weights())

        async with self._lock, anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(receive, engine)
            sent: int = await anyio.to_thread.run_sync(self.pool.sync_weights, version)
        if versions != [version] * len(engines):
            raise WorkerCallError(
                f"engines received weight versions {versions}, not {version}: another sync "
                f"ran on the same group; sync one version at a time",
                error="WeightSyncError",
            )
        return sent


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
