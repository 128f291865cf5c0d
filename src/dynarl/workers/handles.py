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
- :class:`CallChannel`: a worker reached by calls only (a trainer worker).

No torch is imported here.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar, overload

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
from dynarl.workers.weights import WeightManifest, WeightSyncGroup

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=p.SlotReply)

EngineKey = tuple[p.RoleKind | None, tuple[int, ...]]
"""Which engine of a slot: its role, and a rollout engine's devices."""

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
        weight_sync_ranks: ranks its engine takes in the weight-sync group (its
            tensor-parallel size).
    """

    def __init__(self, router: Router, instance: InstanceId, *, weight_sync_ranks: int = 1) -> None:
        self._router = router
        self.instance = instance
        self.weight_sync_ranks = weight_sync_ranks
        """Ranks its engine takes in the weight-sync group."""
        self.state: LifecycleState = "ready"
        """The lifecycle state the worker last reported."""

    async def _call(self, request: p.SlotRequest, expected: type[R]) -> R:
        body = await self._router.call(self.instance, _ENCODER.encode(request))
        reply = _decode(body, expected)
        if isinstance(reply, p.Ack | p.RoleAssumed | p.SlotStats):
            self.state = reply.state
        return reply

    async def stats(self) -> p.SlotStats:
        """The worker's state, role, weight version and load."""
        return await self._call(p.GetStats(), p.SlotStats)

    async def measure_decode(
        self, probe: p.DecodeProbe | None = None
    ) -> tuple[p.DecodeSample, ...]:
        """Probe the decode rate of the slot's rollout engine, idle and active
        (:mod:`dynarl.workers.decode_probe`)."""
        request = p.MeasureDecode() if probe is None else p.MeasureDecode(probe=probe)
        return (await self._call(request, p.DecodeMeasured)).samples

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

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the trainer's weight-sync group as its role (see
        :func:`dynarl.workers.sync_group.connect`, which calls this)."""
        request = p.JoinWeightSync(
            host=group.host,
            port=group.port,
            rank=group.rank,
            world_size=group.world_size,
            timeout_s=group.timeout_s,
            num_ranks=group.num_ranks,
        )
        await self._call(request, p.Ack)

    async def leave_weight_sync(self) -> None:
        """Leave the weight-sync group (see :func:`dynarl.workers.sync_group.connect`,
        which calls this on every member at once)."""
        await self._call(p.LeaveWeightSync(), p.Ack)

    async def update_weights(self, manifest: WeightManifest) -> int:
        """Receive the weights the trainer broadcasts now, as ``manifest`` describes
        them; returns their version. Running requests continue under the new weights
        (re-prefilled)."""
        return (await self._call(p.UpdateWeights(manifest=manifest), p.WeightsUpdated)).version


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
        self.in_weight_sync = False
        """Whether its role holds the slot's place in the weight-sync group (a role it
        takes may not carry over the previous role's)."""
        self.rollout_role: p.RolloutRole | None = None
        """The rollout role it last built or resumed (an engine on those devices)."""
        self.rollout_roles: dict[int, p.RolloutRole] = {}
        """The rollout role of each size it last built or resumed (the slot keeps an
        engine of each size, asleep but the one it serves with), by device count."""
        self._next: InstanceId | None = None
        self._alive = alive or (lambda: True)

    @property
    def alive(self) -> bool:
        """Whether its process still runs (as far as its launcher knows)."""
        return self._alive()

    @property
    def engine(self) -> EngineKey:
        """Which of its engines it serves with: its role, and a rollout engine's
        devices (a slot keeps a rollout engine of each size)."""
        if self.role == "rollout" and self.rollout_role is not None:
            return ("rollout", self.rollout_role.engine_devices)
        return (self.role, ())

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
            reply = await self._call(p.AssumeRole(role=role, instance=instance), p.RoleAssumed)
        except BaseException:
            with contextlib.suppress(RoutingError):
                self._router.reactivate(old)
            raise
        self.role = "rollout" if isinstance(role, p.RolloutRole) else "inference"
        if isinstance(role, p.RolloutRole):
            self.rollout_role = self.rollout_roles[len(role.engine_devices)] = role
            self.weight_sync_ranks = len(role.engine_devices)
        else:
            self.weight_sync_ranks = role.inference.tp
        self.in_weight_sync = reply.in_weight_sync
        self._next = instance

    async def connect_role(self, *, timeout_s: float = 120.0) -> RolloutHandle | InferenceHandle:
        """Second half of :meth:`assume_role`: the slot reconnects as the instance
        :meth:`build_role` named, and its role handle is returned."""
        instance = self._next
        if instance is None or self.role is None:
            raise LaunchError(f"slot {self.name} has no role built to connect; build_role first")
        self._next = None
        await self._router.retire(
            self.instance, reason=f"{self.name} becomes {instance}", reconnect=True
        )
        self.instance = instance
        await self.wait_connected(timeout_s)
        ranks = self.weight_sync_ranks
        if self.role == "rollout":
            return RolloutHandle(self._router, instance, weight_sync_ranks=ranks)
        return InferenceHandle(self._router, instance, weight_sync_ranks=ranks)

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


class CallChannel:
    """A worker reached by typed calls only (it serves no items): a trainer worker.

    Args:
        router: the data router the worker is connected to.
        name: the worker's name, its instance id at the router.
    """

    def __init__(self, router: Router, name: str) -> None:
        self._router = router
        self.name = name

    async def call(self, body: bytes) -> bytes:
        """Send ``body`` as a call and return the reply's body; raises
        :class:`~dynarl.data.errors.DataPlaneError` if the worker is gone."""
        return await self._router.call(InstanceId(self.name), body)
