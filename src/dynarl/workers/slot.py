"""A device slot's server: one worker process's roles, lifecycle and typed calls.

A slot is started once and serves whatever role the controller gives it: a rollout
engine or an inference worker. Switching roles releases the memory of the role it
held (keeping a host copy, so switching back resumes it) and builds or resumes the
other; the process stays. Calls (:mod:`dynarl.workers.protocol`) are dispatched by a
table keyed on the request type; each runs as its own task, so a long ``Generate``
stream does not hold up an ``AbortRequests``. Heavy work (building a model, a weight
transfer, a forward pass) runs in a worker thread; the event loop keeps answering
pings.

Torch is imported only when a role is built, so a slot starts fast and
``dynarl.workers.slot`` imports without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec

from dynarl.control import events as ev
from dynarl.core.errors import DynaRLError
from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import wire
from dynarl.data._tasks import task_group
from dynarl.data.errors import DataPlaneError
from dynarl.data.worker_link import WorkerLink
from dynarl.workers import protocol as p
from dynarl.workers.builders import build_inference, build_rollout
from dynarl.workers.errors import LifecycleError
from dynarl.workers.lifecycle import Lifecycle
from dynarl.workers.rollout_host import CallSink

if TYPE_CHECKING:
    from dynarl.workers.rollout_host import RolloutHost
    from dynarl.workers.torch.inference import InferenceWorker

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(p.AnySlotRequest)

Identity = tuple[InstanceId, ComponentId]
"""What a slot says at hello: the instance it runs and its component."""


class SlotConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one slot process runs.

    Attributes:
        num_threads: torch intra-op threads (a CPU device slot's size).
        capacity: items of the data router it serves at once.
        stats_interval_s: how often an active rollout slot reports its engine's load
            to the controller (an ``EngineStats`` event).
        hello_timeout_s: how long it waits for the controller to answer hello.
        preload: import torch and transformers in the background right after start,
            so that the first role is built without that cost.
    """

    num_threads: int = 1
    capacity: int = 256
    stats_interval_s: float = 1.0
    hello_timeout_s: float = 30.0
    preload: bool = True


class SlotServer:
    """The state of one slot process between calls.

    Args:
        name: the slot's name, also its instance id until its first role.
        config: how it runs.
    """

    def __init__(self, name: str, config: SlotConfig) -> None:
        self.name = name
        self.config = config
        self.lifecycle = Lifecycle(name)
        self.identity: Identity = (InstanceId(name), p.FREE)
        self.next_identity: Identity | None = None
        """Set by ``AssumeRole``: the identity to reconnect as once retired."""
        self._role: p.Role | None = None
        self._rollout: tuple[p.RolloutRole, RolloutHost] | None = None
        self._inference: tuple[p.InferenceRole, InferenceWorker, anyio.Lock] | None = None
        self._sync_group: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._preloaded = anyio.Event()
        if not config.preload:
            self._preloaded.set()
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[p.SlotReply]]] = {
            p.AssumeRole: self._assume_role,
            p.AbortRequests: self._abort,
            p.Score: self._score,
            p.ReleaseMemory: self._release,
            p.ResumeMemory: self._resume,
            p.Drain: self._drain,
            p.Reactivate: self._reactivate,
            p.JoinWeightSync: self._join_weight_sync,
            p.UpdateWeights: self._update_weights,
            p.LeaveWeightSync: self._leave_weight_sync,
            p.GetStats: self._stats,
        }

    # ------------------------------------------------------------------ serving

    async def serve(self, link: WorkerLink) -> None:
        """Answer calls (and serve items, step the engine, report load) on ``link``
        until it is lost; raises the link's ``PeerLostError`` then."""
        if self.lifecycle.state == "starting":
            self.lifecycle.to("ready")
        async with task_group() as tg:
            self._tg = tg
            try:
                if self._rollout is not None:
                    host = self._rollout[1]
                    tg.start_soon(self._run_engine, host, link)
                    tg.start_soon(host.serve_items, link)
                    tg.start_soon(self._report_stats, host, link)
                while True:
                    call = await link.receive_call()
                    tg.start_soon(self._answer, link, call)
            finally:
                self._tg = None
                tg.cancel_scope.cancel()
                if self._rollout is not None:
                    # Nobody listens for the requests still in the engine any more.
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                        await self._rollout[1].abort(None)

    def take_next_identity(self) -> Identity | None:
        """The identity to reconnect as after the link was lost (set by
        ``AssumeRole``), or ``None`` to stop; it becomes the current identity."""
        identity, self.next_identity = self.next_identity, None
        if identity is not None:
            self.identity = identity
        return identity

    async def preload(self) -> None:
        """Import torch and transformers in a thread (roles are built after it)."""

        def load() -> None:
            import torch
            import transformers  # noqa: F401

            torch.set_num_threads(self.config.num_threads)

        try:
            await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
        finally:
            self._preloaded.set()

    def stop(self) -> None:
        """Record a clean shutdown."""
        self.lifecycle.to("stopped")

    async def _answer(self, link: WorkerLink, call: wire.Call) -> None:
        request = None
        try:
            request = _DECODER.decode(call.body)
            if isinstance(request, p.Generate):
                await self._generate(link, call.corr, request)
                return
            reply = await self._handlers[type(request)](request)
        except Exception as error:
            if not isinstance(error, DynaRLError | msgspec.DecodeError):
                logger.exception("%s: %s failed", self.name, type(request).__name__)
            reply = p.Failed(error=type(error).__name__, message=str(error))
        await link.reply(call.corr, _ENCODER.encode(reply))

    # ------------------------------------------------------------------ roles

    async def _assume_role(self, req: p.AssumeRole) -> p.SlotReply:
        life = self.lifecycle
        life.require("ready", "active", "draining", "released", action="assume a role")
        held = self._num_requests()
        if held:
            raise LifecycleError(
                f"{self.name} still holds {held} requests; abort or finish them before "
                f"it assumes another role"
            )
        role = req.role
        # transformers' lazy module is not safe to import from two threads at once.
        await self._preloaded.wait()
        if role == self._role and life.state == "active":
            self.next_identity = (req.instance, role.component)
            return p.Ack(state=life.state)
        if self._role is not None and life.state != "released":
            await self._release_current(host_backup=True)
            life.to("released")
        if isinstance(role, p.RolloutRole):
            if self._rollout is not None and self._rollout[0] == role:
                await self._resume_current(self._rollout[1])
            else:
                threads = self.config.num_threads
                host = await anyio.to_thread.run_sync(build_rollout, role, self.name, threads)
                self._rollout = (role, host)
        elif self._inference is not None and self._inference[0] == role:
            self._inference[1].resume_memory_occupation()
        else:
            worker = await anyio.to_thread.run_sync(build_inference, role, self.config.num_threads)
            self._inference = (role, worker, anyio.Lock())
        self._role = role
        life.to("active")
        self.next_identity = (req.instance, role.component)
        logger.info("%s assumed the %s role as %s", self.name, _kind(role), req.instance)
        return p.Ack(state=life.state)

    async def _release_current(self, *, host_backup: bool) -> None:
        if isinstance(self._role, p.RolloutRole):
            assert self._rollout is not None
            host = self._rollout[1]
            async with host.lock:
                host.paused = True
                host.engine.release_memory_occupation(host_backup=host_backup)
        elif self._inference is not None:
            async with self._inference[2]:
                self._inference[1].release_memory_occupation()

    async def _resume_current(self, host: RolloutHost | None = None) -> None:
        if isinstance(self._role, p.RolloutRole) or host is not None:
            host = host or self._rollout_host()
            async with host.lock:
                host.engine.resume_memory_occupation()
                host.paused = False
            host.wake()
        elif self._inference is not None:
            async with self._inference[2]:
                self._inference[1].resume_memory_occupation()

    def _num_requests(self) -> int:
        if isinstance(self._role, p.RolloutRole):
            return self._rollout_host().num_requests
        if self._inference is not None:
            return self._inference[1].progress().num_pending
        return 0

    def _rollout_host(self) -> RolloutHost:
        if not isinstance(self._role, p.RolloutRole) or self._rollout is None:
            raise LifecycleError(
                f"{self.name} is not a rollout engine (role: {_kind(self._role)}); "
                f"give it the rollout role first"
            )
        return self._rollout[1]

    # ------------------------------------------------------------------ rollout

    async def _generate(self, link: WorkerLink, corr: int, req: p.Generate) -> None:
        self.lifecycle.require("active", action="generate")
        host = self._rollout_host()

        async def send(body: bytes, more: bool) -> None:
            try:
                await link.reply(corr, body, more=more)
            except (anyio.ClosedResourceError, DataPlaneError):
                logger.warning("%s: the link closed before a generate reply went out", self.name)

        sink = CallSink(send, [r.request_id for r in req.requests])
        if req.requests:
            await host.add(req.requests, sink)
        else:
            await sink.flush()

    async def _abort(self, req: p.AbortRequests) -> p.SlotReply:
        ids = None if req.request_ids is None else list(req.request_ids)
        taken = await self._rollout_host().abort(ids)
        return p.Aborted(requests=tuple(taken))

    async def _run_engine(self, host: RolloutHost, link: WorkerLink) -> None:
        await host.run(link)
        if host.error is not None and self.lifecycle.can("failed"):
            self.lifecycle.to("failed")

    async def _report_stats(self, host: RolloutHost, link: WorkerLink) -> None:
        instance = self.identity[0]
        while True:
            await anyio.sleep(self.config.stats_interval_s)
            if self.lifecycle.state in ("active", "draining"):
                load = host.engine.stats()
                await link.report(
                    ev.EngineStats(
                        time_s=0.0,
                        instance=instance,
                        kv_usage=load.kv_usage,
                        num_running=load.num_running,
                        num_queued=load.num_queued,
                        gen_tokens_per_s=load.gen_tokens_per_s,
                        kv_tokens=load.kv_tokens,
                    )
                )

    # ------------------------------------------------------------------ inference

    async def _score(self, req: p.Score) -> p.SlotReply:
        self.lifecycle.require("active", action="score samples")
        if not isinstance(self._role, p.InferenceRole) or self._inference is None:
            raise LifecycleError(
                f"{self.name} is not an inference worker (role: {_kind(self._role)}); "
                f"give it the inference role first"
            )
        _, worker, lock = self._inference
        async with lock:
            worker.submit(req.requests)
            results = await anyio.to_thread.run_sync(worker.run)
        return p.Scored(results=tuple(results))

    # ------------------------------------------------------------------ memory, state

    async def _release(self, req: p.ReleaseMemory) -> p.SlotReply:
        self.lifecycle.require("active", "draining", action="release memory")
        await self._release_current(host_backup=req.host_backup)
        self.lifecycle.to("released")
        return p.Ack(state=self.lifecycle.state)

    async def _resume(self, req: p.ResumeMemory) -> p.SlotReply:
        self.lifecycle.require("released", action="resume memory")
        await self._resume_current()
        self.lifecycle.to("active")
        return p.Ack(state=self.lifecycle.state)

    async def _drain(self, req: p.Drain) -> p.SlotReply:
        self.lifecycle.require("active", "draining", action="drain")
        self.lifecycle.to("draining")
        return p.Ack(state=self.lifecycle.state)

    async def _reactivate(self, req: p.Reactivate) -> p.SlotReply:
        self.lifecycle.require("draining", "active", action="reactivate")
        self.lifecycle.to("active")
        return p.Ack(state=self.lifecycle.state)

    # ------------------------------------------------------------------ weights

    async def _join_weight_sync(self, req: p.JoinWeightSync) -> p.SlotReply:
        import torch

        from dynarl.workers.torch.weight_sync import join_weight_sync_group

        def join() -> Any:
            return join_weight_sync_group(
                host=req.host,
                port=req.port,
                rank=req.rank,
                world_size=req.world_size,
                device=torch.device("cpu"),
                timeout_s=req.timeout_s,
            )

        self._sync_group = await anyio.to_thread.run_sync(join)
        return p.Ack(state=self.lifecycle.state)

    async def _leave_weight_sync(self, req: p.LeaveWeightSync) -> p.SlotReply:
        from dynarl.workers.torch.weight_sync import leave_weight_sync_group

        if self._sync_group is not None:
            group, self._sync_group = self._sync_group, None
            await anyio.to_thread.run_sync(leave_weight_sync_group, group)
        return p.Ack(state=self.lifecycle.state)

    async def _update_weights(self, req: p.UpdateWeights) -> p.SlotReply:
        self.lifecycle.require("active", "draining", action="update weights")
        if self._sync_group is None:
            raise LifecycleError(f"{self.name} is in no weight-sync group; join one first")
        group = self._sync_group
        if isinstance(self._role, p.InferenceRole) and self._inference is not None:
            _, worker, lock = self._inference
            async with lock:
                version = await anyio.to_thread.run_sync(worker.update_weights, group)
            return p.WeightsUpdated(version=version)
        host = self._rollout_host()
        async with host.lock:
            version = await anyio.to_thread.run_sync(host.engine.update_weights, group)
        host.wake()
        return p.WeightsUpdated(version=version)

    async def _stats(self, req: p.GetStats) -> p.SlotReply:
        stats = p.SlotStats(
            state=self.lifecycle.state,
            role=None if self._role is None else _kind(self._role),
            instance=self.identity[0],
            pid=os.getpid(),
        )
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            engine = self._rollout[1].engine
            return msgspec.structs.replace(
                stats, weight_version=engine.weight_version, load=engine.stats()
            )
        if isinstance(self._role, p.InferenceRole) and self._inference is not None:
            worker = self._inference[1]
            return msgspec.structs.replace(
                stats, weight_version=worker.weight_version, progress=worker.progress()
            )
        return stats


def _kind(role: p.Role | None) -> p.RoleKind | None:
    if role is None:
        return None
    return "rollout" if isinstance(role, p.RolloutRole) else "inference"
