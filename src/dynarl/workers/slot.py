"""A device slot's server: one worker process's roles, lifecycle and typed calls.

A slot is started once and serves whatever role the controller gives it: a rollout
engine or an inference worker, each built by the backend its section names
(:mod:`dynarl.workers.backends`) and driven through its role protocol
(:class:`~dynarl.workers.rollout.RolloutEngine`,
:class:`~dynarl.workers.inference.InferenceEngine`). Switching roles releases the
memory of the role it held (keeping a host copy, so switching back resumes it) and
builds or resumes the other; the process stays. Calls (:mod:`dynarl.workers.protocol`)
are dispatched by a table keyed on the request type; each runs as its own task, so a
long ``Generate`` stream does not hold up an ``AbortRequests``. The data router's items
reach the role that serves them (:mod:`dynarl.workers.item_feeds`): rollout requests,
or samples to score.

No backend is imported until a role is built, so a slot starts fast.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.abc
import msgspec

from dynarl.core.errors import DynaRLError
from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import wire
from dynarl.data._tasks import task_group
from dynarl.data.errors import DataPlaneError
from dynarl.data.worker_link import WorkerLink
from dynarl.workers import backends
from dynarl.workers import item_feeds as feeds
from dynarl.workers import protocol as p
from dynarl.workers.config import SLOT_CAPACITY
from dynarl.workers.decode_probe import probe_role
from dynarl.workers.errors import LifecycleError
from dynarl.workers.inference import InferenceEngine
from dynarl.workers.lifecycle import Lifecycle
from dynarl.workers.load_reports import LoadReporter
from dynarl.workers.rollout import RolloutEngine
from dynarl.workers.sinks import CallSink
from dynarl.workers.weights import WeightReceiver, WeightSyncGroup

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
        preload_modules: modules to import in the background right after start (the
            backends' own, e.g. torch and transformers), so that the first role is
            built without that cost.
        import_warnings: how the warnings begin (``UserWarning``) that those modules
            give when they load and that concern no user: this process ignores them.
    """

    num_threads: int = 1
    capacity: int = SLOT_CAPACITY
    stats_interval_s: float = 1.0
    hello_timeout_s: float = 30.0
    preload_modules: tuple[str, ...] = ()
    import_warnings: tuple[str, ...] = ()


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
        self._rollout: tuple[p.RolloutRole, RolloutEngine] | None = None
        # Rollout engines of other sizes than the current one, asleep (memory released),
        # by their device count: a regroup for the tail resumes one, launching nothing.
        self._parked: dict[int, tuple[p.RolloutRole, RolloutEngine]] = {}
        self._inference: tuple[p.InferenceRole, InferenceEngine] | None = None
        self._sync_holder: WeightReceiver | None = None
        self._streamed: set[str] = set()  # requests of Generate calls, not items
        self._reporter: LoadReporter | None = None  # while a rollout link is fed
        self._running: set[int] = set()  # ids of the rollout engines whose loop runs
        self._preloaded = anyio.Event()
        if not config.preload_modules:
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
            p.MeasureDecode: self._measure_decode,
        }

    # ------------------------------------------------------------------ serving

    async def serve(self, link: WorkerLink) -> None:
        """Answer calls (and serve items, run the engine, report load) on ``link``
        until it is lost; raises the link's ``PeerLostError`` then."""
        if self.lifecycle.state == "starting":
            self.lifecycle.to("ready")
        async with task_group() as tg:
            try:
                if self._rollout is not None:
                    tg.start_soon(self._run_engine, self._rollout[1])
                if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
                    tg.start_soon(self._feed_rollout, self._rollout[1], link)
                elif isinstance(self._role, p.InferenceRole) and self._inference is not None:
                    tg.start_soon(feeds.feed_inference, self._inference[1], link)
                while True:
                    call = await link.receive_call()
                    tg.start_soon(self._answer, link, call)
            finally:
                tg.cancel_scope.cancel()
                if self._rollout is not None and self._rollout[1].num_requests:
                    # Nobody listens for the requests still in the engine any more.
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                        await self._rollout[1].abort(None)

    @property
    def slots(self) -> int:
        """Items it runs at once in its role, as it tells the router at hello: a
        rollout engine's batch (its ``max_running_requests``: the configured one, or an
        SGLang server's own; the rest of its capacity waits in the engine's queue, so
        its admissions batch), else 0 (all it takes)."""
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            return self._rollout[1].max_running_requests
        return 0

    def take_next_identity(self) -> Identity | None:
        """The identity to reconnect as after the link was lost (set by
        ``AssumeRole``), or ``None`` to stop; it becomes the current identity."""
        identity, self.next_identity = self.next_identity, None
        if identity is not None:
            self.identity = identity
        return identity

    async def preload(self) -> None:
        """Import the backends' modules in a thread (roles are built after it)."""

        def load() -> None:
            for module in self.config.preload_modules:
                importlib.import_module(module)

        for start in self.config.import_warnings:  # before the thread: filters are global
            warnings.filterwarnings("ignore", message=re.escape(start), category=UserWarning)
        try:
            await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
        finally:
            self._preloaded.set()

    def stop(self) -> None:
        """Record a clean shutdown, closing the rollout engine (a server it launched
        stops with the slot)."""
        self.close()
        self.lifecycle.to("stopped")

    def close(self) -> None:
        """Close the rollout engines built here, if any, side by side (a server each
        engine launched takes seconds to stop; idempotent)."""
        built = [*self._parked.values(), *([self._rollout] if self._rollout else [])]
        engines = [engine for _, engine in built]
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            for closed in [pool.submit(engine.close) for engine in engines]:
                closed.result()

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
            held = self._sync_holder is not None and self._sync_holder is self._active()
            return p.RoleAssumed(state=life.state, in_weight_sync=held)
        if self._role is not None and life.state != "released":
            await self._release_current()
            life.to("released")
        threads = self.config.num_threads
        if isinstance(role, p.RolloutRole):
            self._take_rollout_of_size(len(role.engine_devices))
            if self._rollout is not None and self._rollout[0] == role:
                await self._rollout[1].resume_memory()
            else:
                if self._rollout is not None:
                    await self._close_rollout()
                backend = backends.rollout_backend(role.rollout)
                engine = await anyio.to_thread.run_sync(
                    lambda: backend.build_rollout(role, name=self.name, num_threads=threads)
                )
                self._rollout = (role, engine)
        elif self._inference is not None and self._inference[0] == role:
            await self._inference[1].resume_memory()
        else:
            inference = backends.inference_backend(role.inference)
            worker = await anyio.to_thread.run_sync(
                lambda: inference.build_inference(role, name=self.name, num_threads=threads)
            )
            self._inference = (role, worker)
        self._role = role
        life.to("active")
        self.next_identity = (req.instance, role.component)
        logger.info("%s assumed the %s role as %s", self.name, _kind(role), req.instance)
        return p.RoleAssumed(state=life.state, in_weight_sync=self._carry_weight_sync())

    def _take_rollout_of_size(self, size: int) -> None:
        """Make the rollout engine of ``size`` devices built here (if any) the current
        one, parking the current one if it has another size (it is released: the slot
        released its role before it takes another)."""
        current = self._rollout
        if current is not None and len(current[0].engine_devices) == size:
            return
        if current is not None:
            self._parked[len(current[0].engine_devices)] = current
        self._rollout = self._parked.pop(size, None)

    async def _close_rollout(self) -> None:
        """Close the rollout engine built here for other devices of the same size (a
        server it launched stops, freeing its GPUs and its port for the engine that
        replaces it). Its place in a weight-sync group goes with it: the controller
        abandons that group."""
        assert self._rollout is not None
        engine = self._rollout[1]
        self._rollout = None
        if self._sync_holder is engine:
            self._sync_holder = None
        await anyio.to_thread.run_sync(engine.close)

    def _carry_weight_sync(self) -> bool:
        """Hand the slot's place in the weight-sync group to the role it now serves,
        if the backend can (two torch roles share their process's group)."""
        engine, holder = self._active(), self._sync_holder
        if engine is None or holder is None:
            return False
        if holder is engine or engine.adopt_weight_sync(holder):
            self._sync_holder = engine
            return True
        return False

    def _active(self) -> RolloutEngine | InferenceEngine | None:
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            return self._rollout[1]
        if isinstance(self._role, p.InferenceRole) and self._inference is not None:
            return self._inference[1]
        return None

    async def _release_current(self, *, host_backup: bool = True) -> None:
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            await self._rollout[1].release_memory(host_backup=host_backup)
        elif self._inference is not None:
            await self._inference[1].release_memory()

    async def _resume_current(self) -> None:
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            await self._rollout[1].resume_memory()
        elif self._inference is not None:
            await self._inference[1].resume_memory()

    def _num_requests(self) -> int:
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            return self._rollout[1].num_requests
        if self._inference is not None:
            return self._inference[1].progress().num_pending
        return 0

    def _rollout_engine(self) -> RolloutEngine:
        if not isinstance(self._role, p.RolloutRole) or self._rollout is None:
            raise LifecycleError(
                f"{self.name} is not a rollout engine (role: {_kind(self._role)}); "
                f"give it the rollout role first"
            )
        return self._rollout[1]

    def _inference_engine(self) -> InferenceEngine:
        if not isinstance(self._role, p.InferenceRole) or self._inference is None:
            raise LifecycleError(
                f"{self.name} is not an inference worker (role: {_kind(self._role)}); "
                f"give it the inference role first"
            )
        return self._inference[1]

    # ------------------------------------------------------------------ rollout

    async def _generate(self, link: WorkerLink, corr: int, req: p.Generate) -> None:
        self.lifecycle.require("active", action="generate")
        engine = self._rollout_engine()

        async def send(body: bytes, more: bool) -> None:
            try:
                await link.reply(corr, body, more=more)
            except (anyio.ClosedResourceError, DataPlaneError):
                logger.warning("%s: the link closed before a generate reply went out", self.name)

        ids = [r.request_id for r in req.requests]
        sink = CallSink(send, ids, settled=self._streamed.discard)
        if req.requests:
            await engine.submit(req.requests, sink)
            self._streamed.update(ids)
        else:
            await sink.flush()

    async def _abort(self, req: p.AbortRequests) -> p.SlotReply:
        ids = None if req.request_ids is None else list(req.request_ids)
        streamed = set(self._streamed)
        taken = await self._rollout_engine().abort(ids)
        # Items go back to the router through their sinks; the call returns the rest.
        return p.Aborted(requests=tuple(r for r in taken if r.request_id in streamed))

    async def _feed_rollout(self, engine: RolloutEngine, link: WorkerLink) -> None:
        reporter = self._reporter = LoadReporter(engine, link, self.identity[0])
        try:
            await feeds.feed_rollout(
                engine,
                link,
                reporter=reporter,
                stats_interval_s=self.config.stats_interval_s,
                reporting=lambda: self.lifecycle.state in ("active", "draining"),
            )
        finally:
            self._reporter = None

    async def _run_engine(self, engine: RolloutEngine) -> None:
        self._running.add(id(engine))
        try:
            await engine.run()
        finally:
            self._running.discard(id(engine))
        if engine.error is not None and self.lifecycle.can("failed"):
            self.lifecycle.to("failed")

    async def _measure_decode(self, req: p.MeasureDecode) -> p.SlotReply:
        """Probe the rollout engine's decode rate (:mod:`dynarl.workers.decode_probe`),
        running its loop for the while if no link runs it (a slot that built the role
        but is not connected as it)."""
        self.lifecycle.require("active", action="measure decode")
        engine = self._rollout_engine()
        assert self._rollout is not None
        async with task_group() as tg:
            if id(engine) not in self._running:
                tg.start_soon(self._run_engine, engine)
            samples = await probe_role(engine, self._rollout[0], req.probe)
            tg.cancel_scope.cancel()
        return p.DecodeMeasured(samples=tuple(samples))

    # ------------------------------------------------------------------ inference

    async def _score(self, req: p.Score) -> p.SlotReply:
        self.lifecycle.require("active", action="score samples")
        results = await self._inference_engine().score(req.requests)
        return p.Scored(results=tuple(results))

    # ------------------------------------------------------------------ memory, state

    async def _release(self, req: p.ReleaseMemory) -> p.SlotReply:
        self.lifecycle.require("active", "draining", action="release memory")
        if self._reporter is not None and isinstance(self._role, p.RolloutRole):
            await self._reporter.report()  # its last steps, before it stops serving
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
        engine = self._active()
        if engine is None:
            raise LifecycleError(f"{self.name} has no role to receive weights; assume one first")
        group = WeightSyncGroup(
            host=req.host,
            port=req.port,
            rank=req.rank,
            world_size=req.world_size,
            timeout_s=req.timeout_s,
            num_ranks=req.num_ranks,
        )
        await engine.join_weight_sync(group)
        self._sync_holder = engine
        return p.Ack(state=self.lifecycle.state)

    async def _leave_weight_sync(self, req: p.LeaveWeightSync) -> p.SlotReply:
        holder, self._sync_holder = self._sync_holder, None
        if holder is not None:
            await holder.leave_weight_sync()
        return p.Ack(state=self.lifecycle.state)

    async def _update_weights(self, req: p.UpdateWeights) -> p.SlotReply:
        self.lifecycle.require("active", "draining", action="update weights")
        engine = self._active()
        if engine is None or engine is not self._sync_holder:
            raise LifecycleError(
                f"{self.name} is in no weight-sync group as its {_kind(self._role)} role; "
                "join one first"
            )
        return p.WeightsUpdated(version=await engine.receive_weights(req.manifest))

    async def _stats(self, req: p.GetStats) -> p.SlotReply:
        stats = p.SlotStats(
            state=self.lifecycle.state,
            role=None if self._role is None else _kind(self._role),
            instance=self.identity[0],
            pid=os.getpid(),
        )
        if isinstance(self._role, p.RolloutRole) and self._rollout is not None:
            engine = self._rollout[1]
            return msgspec.structs.replace(
                stats, weight_version=engine.weight_version, load=engine.load()
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
