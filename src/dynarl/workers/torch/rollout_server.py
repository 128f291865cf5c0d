"""The torch rollout engine behind the :class:`~dynarl.workers.rollout.RolloutEngine`
protocol: stepped in a worker thread so the hosting process's event loop stays free.

The engine is synchronous and not thread-safe, so every use of it (a step, adding or
aborting requests, a weight update, releasing memory) happens under one lock, one at a
time; a step runs in a thread (``anyio.to_thread``) while the loop goes on answering
calls. Each request's outcome goes to the sink it was submitted with.
"""

import logging
from collections.abc import Iterable, Sequence

import anyio
import torch

from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import (
    Completion,
    EngineLoad,
    GenerateRequest,
    RequestSink,
)
from dynarl.workers.torch import weight_sync
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.weights import WeightManifest, WeightReceiver, WeightSyncGroup

logger = logging.getLogger(__name__)


class TorchRollout:
    """Drives a :class:`~dynarl.workers.torch.engine.RolloutEngine` from an event loop.

    Args:
        engine: the engine (its waiting queue is the data plane's request queue).
        name: for log lines.
    """

    def __init__(self, engine: RolloutEngine, *, name: str) -> None:
        self.engine = engine
        self.name = name
        self._lock = anyio.Lock()
        self._paused = False
        self._error: Exception | None = None
        self._sinks: dict[str, RequestSink] = {}
        self._work = anyio.Event()
        self.sync = weight_sync.Membership()
        """Its place in the weight-sync group."""

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine runs."""
        return self.engine.weight_version

    @property
    def max_running_requests(self) -> int:
        """Requests the engine decodes at once (``rollout.max_running_requests``)."""
        return self.engine.max_running_requests

    @property
    def num_requests(self) -> int:
        """Requests in the engine (waiting or running)."""
        return len(self._sinks)

    @property
    def error(self) -> Exception | None:
        """Why stepping stopped for good."""
        return self._error

    async def submit(self, requests: Sequence[GenerateRequest], sink: RequestSink) -> None:
        """Queue ``requests``; their outcomes go to ``sink``. All or none are added."""
        async with self._lock:
            ids = [r.request_id for r in requests]
            clash = set(ids) & self._sinks.keys()
            if clash or len(set(ids)) != len(ids):
                raise BadRequestError(
                    f"requests {sorted(clash) or ids} are already in this engine; use new ids"
                )
            added: list[str] = []
            try:
                for request in requests:
                    self.engine.add_request(request)
                    added.append(request.request_id)
            except BaseException:
                self.engine.abort(added)
                raise
            for rid in added:
                self._sinks[rid] = sink
        self._wake()

    async def abort(self, request_ids: Sequence[str] | None) -> list[GenerateRequest]:
        """Take requests out (all when ``None``); each sink hears of its own."""
        async with self._lock:
            taken = self.engine.abort(request_ids)
        sinks = []
        for request in taken:
            sink = self._sinks.pop(request.request_id)
            sink.aborted(request)
            sinks.append(sink)
        await _flush(sinks)
        return taken

    async def end_sessions(self, session_ids: Sequence[str]) -> None:
        """Drop the ended sessions' cached prefixes."""
        async with self._lock:
            for session in session_ids:
                self.engine.end_session(session)

    def load(self) -> EngineLoad:
        """The engine's load figures."""
        return self.engine.stats()

    async def release_memory(self, *, host_backup: bool) -> None:
        """Stop stepping and free the weights and KV cache."""
        async with self._lock:
            self._paused = True
            self.engine.release_memory_occupation(host_backup=host_backup)

    async def resume_memory(self) -> None:
        """Allocate the memory again and go on stepping."""
        async with self._lock:
            self.engine.resume_memory_occupation()
            self._paused = False
        self._wake()

    def close(self) -> None:
        """Nothing to free outside this process."""

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the trainer's weight-sync group."""
        await self.sync.join(group, device=_device(self.engine.model.parameters()))

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Receive the broadcast ``manifest`` describes into the engine's weights;
        running requests continue under the new weights (re-prefilled)."""
        if self.sync.group is None:
            raise EngineError(f"{self.name} is in no weight-sync group; join one first")
        async with self._lock:
            version = await anyio.to_thread.run_sync(
                self.engine.update_weights, self.sync.group, manifest
            )
        self._wake()
        return version

    def adopt_weight_sync(self, other: WeightReceiver) -> bool:
        """Take ``other``'s membership if it is a torch engine of this process."""
        return self.sync.adopt(getattr(other, "sync", None))

    async def leave_weight_sync(self) -> None:
        """Leave the weight-sync group."""
        await self.sync.leave()

    async def run(self) -> None:
        """Step while there is work and the memory is held. If a step raises, every
        request's sink fails, the error is kept in :attr:`error` and this returns."""
        engine = self.engine
        while self._error is None:
            if self._paused or not self._sinks:
                self._work = anyio.Event()
                await self._work.wait()
                continue
            try:
                async with self._lock:
                    if self._paused:
                        continue
                    outputs = await anyio.to_thread.run_sync(engine.step)
            except Exception as e:
                logger.exception("%s: engine step failed; the engine has failed", self.name)
                self._error = e
                sinks, self._sinks = list(self._sinks.values()), {}
                for sink in {id(s): s for s in sinks}.values():
                    await sink.fail(e)
                return
            touched = []
            for out in outputs:
                if isinstance(out, Completion):
                    sink = self._sinks.pop(out.request_id)
                    sink.done(out)
                    touched.append(sink)
            await _flush(touched)
            await anyio.lowlevel.checkpoint()

    def _wake(self) -> None:
        self._work.set()


def _device(parameters: Iterable[torch.nn.Parameter]) -> torch.device:
    return next(iter(parameters)).device


async def _flush(sinks: Iterable[RequestSink]) -> None:
    seen: set[int] = set()
    for sink in sinks:
        if id(sink) not in seen:
            seen.add(id(sink))
            await sink.flush()
