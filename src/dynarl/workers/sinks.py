"""Where a rollout request's outcome goes, in a slot process: back to a streamed
``Generate`` call (:class:`CallSink`), or to the data router as the item it came as
(:class:`ItemSink`: completed with the :class:`~dynarl.workers.rollout.Completion` as its
payload — a multi-turn episode's turn goes to its environment instead — or handed back
``aborted`` with the partial request as its payload, which
another engine resumes). Both implement :class:`~dynarl.workers.rollout.RequestSink`;
:class:`EachSink` submits many requests in one call, each with a sink of its own.
"""

from collections.abc import Awaitable, Callable, Iterable, Mapping

import msgspec

from dynarl.data import wire
from dynarl.data.worker_link import WorkerLink
from dynarl.workers.protocol import Failed, Generated
from dynarl.workers.rollout import Completion, GenerateRequest, RequestSink

_ENCODER = msgspec.msgpack.Encoder()


class CallSink:
    """The requests of one streamed ``Generate`` call: completions go back as
    ``Generated`` replies, one per engine step that finished any; the last reply
    (``more=False``) goes when none of its requests is left in the engine.
    ``settled`` hears of each request that left the engine (finished or aborted)."""

    def __init__(
        self,
        send: Callable[[bytes, bool], Awaitable[None]],
        ids: Iterable[str],
        *,
        settled: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        self._send = send
        self._settled = settled
        self._pending = set(ids)
        self._buffer: list[Completion] = []
        self._dirty = True  # a call with no requests still gets its final reply
        self.closed = False

    def done(self, completion: Completion) -> None:
        """Buffer ``completion`` for the next reply."""
        self._pending.discard(completion.request_id)
        self._settled(completion.request_id)
        self._buffer.append(completion)
        self._dirty = True

    def aborted(self, request: GenerateRequest) -> None:
        """Forget ``request``: the abort call returns it."""
        self._pending.discard(request.request_id)
        self._settled(request.request_id)
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
        for request_id in self._pending:
            self._settled(request_id)
        if not self.closed:
            self.closed = True
            failed = Failed(error=type(error).__name__, message=str(error))
            await self._send(_ENCODER.encode(failed), False)


class ItemSink:
    """One item of the data router, served by the engine.

    A turn of a multi-turn episode (``multi_turn``) is handed back as a session going
    to its environment (status ``tool_call``), to return for its next turn; any other
    request completes the item."""

    def __init__(
        self, link: WorkerLink, item: wire.Item, num_tokens_before: int, *, multi_turn: bool
    ) -> None:
        self._link = link
        self._item = item
        self._before = num_tokens_before
        self._multi_turn = multi_turn

    def done(self, completion: Completion) -> None:
        """Complete the item (or end its turn) with the completion as its payload."""
        self._link.complete(
            wire.ItemResult(
                item=self._item.id,
                status="tool_call" if self._multi_turn else "done",
                payload=_ENCODER.encode(completion),
                num_tokens=len(completion.output_ids) - self._before,
                prefix_tokens=completion.cached_tokens,
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


class EachSink:
    """The requests of one submission, each with its own sink: every outcome goes to
    its request's sink, by request id, so a batch of items goes to an engine in one
    ``submit`` (one turn of its lock) rather than one submission per item.

    Args:
        sinks: each request's sink, by request id.
    """

    def __init__(self, sinks: Mapping[str, RequestSink]) -> None:
        self._sinks = dict(sinks)
        self._touched: dict[int, RequestSink] = {}

    def done(self, completion: Completion) -> None:
        """Hand ``completion`` to its request's sink."""
        self._settle(completion.request_id).done(completion)

    def aborted(self, request: GenerateRequest) -> None:
        """Hand ``request`` back through its own sink."""
        self._settle(request.request_id).aborted(request)

    async def flush(self) -> None:
        """Flush the sinks that heard of an outcome since the last flush."""
        touched, self._touched = self._touched, {}
        for sink in touched.values():
            await sink.flush()

    async def fail(self, error: Exception) -> None:
        """Fail every request whose outcome is still to come."""
        left, self._sinks = self._sinks, {}
        for sink in {id(s): s for s in left.values()}.values():
            await sink.fail(error)

    def _settle(self, request_id: str) -> RequestSink:
        sink = self._sinks.pop(request_id)
        self._touched[id(sink)] = sink
        return sink
