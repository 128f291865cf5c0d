"""A rollout engine inside a worker process: stepped in a worker thread so that the
process's event loop stays free, fed by typed calls and by the data router's items.

The engine is synchronous and not thread-safe, so every use of it — a step, adding or
aborting requests, a weight update, releasing memory — happens under one lock, one at
a time; a step runs in a thread (``anyio.to_thread``) while the loop goes on answering
pings and calls. Each request has a *sink* that receives its completion or its
abort: a streamed :class:`~dynarl.workers.protocol.Generate` call, or an item of the
data router (completed with the :class:`~dynarl.workers.rollout.Completion` as
its payload, or handed back ``aborted`` with the partial request as its payload, which
another engine resumes). Importing this module does not import torch.
"""

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec

from dynarl.core.ids import ItemId
from dynarl.data import wire
from dynarl.data.errors import PeerLostError
from dynarl.data.worker_link import WorkerLink
from dynarl.workers.protocol import Failed, Generated
from dynarl.workers.rollout import Completion, GenerateRequest
from dynarl.workers.torch.errors import EngineError

if TYPE_CHECKING:
    from dynarl.workers.torch.engine import RolloutEngine

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(GenerateRequest)


class Sink(Protocol):
    """Where one request's outcome goes."""

    def done(self, completion: Completion) -> None:
        """The request finished."""
        ...

    def aborted(self, request: GenerateRequest) -> None:
        """The request was taken out with its partial output."""
        ...

    async def flush(self) -> None:
        """Send what :meth:`done` and :meth:`aborted` buffered."""
        ...

    async def fail(self, error: Exception) -> None:
        """The engine failed; the request's outcome is lost."""
        ...


class CallSink:
    """The requests of one streamed ``Generate`` call: completions go back as
    ``Generated`` replies, one per engine step that finished any; the last reply
    (``more=False``) goes when none of its requests is left in the engine."""

    def __init__(self, send: Callable[[bytes, bool], Awaitable[None]], ids: Iterable[str]) -> None:
        self._send = send
        self._pending = set(ids)
        self._buffer: list[Completion] = []
        self._dirty = True  # a call with no requests still gets its final reply
        self.closed = False

    def done(self, completion: Completion) -> None:
        """Buffer ``completion`` for the next reply."""
        self._pending.discard(completion.request_id)
        self._buffer.append(completion)
        self._dirty = True

    def aborted(self, request: GenerateRequest) -> None:
        """Forget ``request``: the abort call returns it."""
        self._pending.discard(request.request_id)
        self._dirty = True

    async def flush(self) -> None:
        """Send the buffered completions (and the final reply once nothing is left)."""
        if self.closed or not self._dirty:
            return
        self._dirty = False
        batch, self._buffer = tuple(self._buffer), []
        more = bool(self._pending)
        self.closed = not more
        if batch or not more:
            await self._send(_ENCODER.encode(Generated(completions=batch)), more)

    async def fail(self, error: Exception) -> None:
        """End the call with a ``Failed`` reply."""
        if not self.closed:
            self.closed = True
            failed = Failed(error=type(error).__name__, message=str(error))
            await self._send(_ENCODER.encode(failed), False)


class ItemSink:
    """One item of the data router, served by the engine."""

    def __init__(self, link: WorkerLink, item: wire.Item, num_tokens_before: int) -> None:
        self._link = link
        self._item = item
        self._before = num_tokens_before

    def done(self, completion: Completion) -> None:
        """Complete the item with the completion as its payload."""
        self._link.complete(
            wire.ItemResult(
                item=self._item.id,
                payload=_ENCODER.encode(completion),
                num_tokens=len(completion.output_ids) - self._before,
            )
        )

    def aborted(self, request: GenerateRequest) -> None:
        """Hand the item back with the partial request as its payload."""
        self._link.complete(
            wire.ItemResult(
                item=self._item.id,
                status="aborted",
                payload=_ENCODER.encode(request),
                num_tokens=len(request.output_ids) - self._before,
            )
        )

    async def flush(self) -> None:
        """Nothing to do: the link batches results itself."""

    async def fail(self, error: Exception) -> None:
        """Hand the item back as it came, for another engine to serve."""
        self._link.complete(
            wire.ItemResult(
                item=self._item.id,
                status="aborted",
                payload=self._item.payload,
                prefix_tokens=self._item.prefix_tokens,
            )
        )


class RolloutHost:
    """Drives ``engine`` from an event loop.

    Args:
        engine: the engine (its waiting queue is the data plane's request queue).
        name: for log lines.
    """

    def __init__(self, engine: "RolloutEngine", *, name: str) -> None:
        self.engine = engine
        self.name = name
        self.lock = anyio.Lock()
        """Held while anything uses the engine."""
        self.paused = False
        """Do not step (memory released)."""
        self.error: Exception | None = None
        """Why stepping stopped for good."""
        self._sinks: dict[str, Sink] = {}
        self._work = anyio.Event()

    @property
    def num_requests(self) -> int:
        """Requests in the engine (waiting or running)."""
        return len(self._sinks)

    async def add(self, requests: Sequence[GenerateRequest], sink: Sink) -> None:
        """Queue ``requests``; their outcomes go to ``sink``. All or none are added.

        Raises :class:`EngineError` (adding none) for a duplicate id or a bad request.
        """
        async with self.lock:
            ids = [r.request_id for r in requests]
            clash = set(ids) & self._sinks.keys()
            if clash or len(set(ids)) != len(ids):
                raise EngineError(f"requests {sorted(clash) or ids} are already in this engine")
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
        self.wake()

    async def abort(self, request_ids: Sequence[str] | None) -> list[GenerateRequest]:
        """Take requests out (all when ``None``); each sink hears of its own. Returns
        the partial requests of streamed calls (items go back to the router)."""
        async with self.lock:
            taken = self.engine.abort(request_ids)
        returned = []
        sinks = []
        for request in taken:
            sink = self._sinks.pop(request.request_id)
            sink.aborted(request)
            sinks.append(sink)
            if isinstance(sink, CallSink):
                returned.append(request)
        await _flush(sinks)
        return returned

    async def serve_items(self, link: WorkerLink) -> None:
        """Feed the router's items (payload: a msgpack ``GenerateRequest``) to the
        engine until the link is lost."""
        while True:
            try:
                items = await link.receive()
            except PeerLostError:
                return
            for item in items:
                try:
                    request = _REQUEST.decode(item.payload)
                except msgspec.DecodeError as e:
                    logger.error("%s: item %s is not a GenerateRequest: %s", self.name, item.id, e)
                    link.complete(wire.ItemResult(item=item.id, payload=b""))
                    continue
                request = msgspec.structs.replace(request, request_id=item.id)
                sink = ItemSink(link, item, len(request.output_ids))
                try:
                    await self.add([request], sink)
                except EngineError as e:
                    logger.error("%s: item %s refused: %s", self.name, item.id, e)
                    link.complete(wire.ItemResult(item=item.id, payload=b""))

    def wake(self) -> None:
        """Tell the step loop there may be work."""
        self._work.set()

    async def run(self, link: WorkerLink) -> None:
        """Step while there is work and the host is not paused; hand back items the
        controller asked for. If a step raises, every request's sink fails, the error
        is kept in :attr:`error` and this returns."""
        engine = self.engine
        while self.error is None:
            if self.paused or not self._sinks:
                self._work = anyio.Event()
                await self._work.wait()
                continue
            wanted = [rid for rid in self._sinks if link.abort_requested(ItemId(rid))]
            if wanted:
                await self.abort(wanted)
                continue
            try:
                async with self.lock:
                    if self.paused:
                        continue
                    outputs = await anyio.to_thread.run_sync(engine.step)
            except Exception as e:
                logger.exception("%s: engine step failed; the slot has failed", self.name)
                self.error = e
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


async def _flush(sinks: Iterable[Sink]) -> None:
    seen: set[int] = set()
    for sink in sinks:
        if id(sink) not in seen:
            seen.add(id(sink))
            await sink.flush()
