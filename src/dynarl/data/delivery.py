"""Results on their way from the workers to the router's consumer, at its pace.

The router reads workers' frames in batches and dispatches each batch
(:class:`~dynarl.data.sessions.Sessions`). A result counts only from the instance that
holds its item (:meth:`~dynarl.data.placement.Placement.on_result`), so a stale one is
rejected and counted, never delivered twice. A batch's completions wait in an outbox
and go to the consumer, in arrival order, through a bounded memory object stream
before the next batch is read. A consumer that does not keep up fills the stream: the
router stops reading frames, which stops the workers (ZeroMQ high-water marks), and
while it waits the liveness watch counts the silence against no one.
"""

from collections.abc import Sequence

import anyio

from dynarl.core.clock import Clock
from dynarl.data import wire
from dynarl.data.codec import Rejections
from dynarl.data.errors import RoutingError
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement, RoutedResult
from dynarl.data.sessions import Sessions
from dynarl.data.transport import Transport


class ResultDelivery:
    """The router's results: applied to the placement as they arrive, held in an
    outbox, handed to the consumer through :attr:`stream`; :meth:`receive_loop` reads
    the frames they come in, at the consumer's pace.

    Args:
        transport: the controller's end, read by :meth:`receive_loop`.
        placement: the router's item table (applies each result).
        rejections: where stale results are counted (``rejected["stale"]``).
        clock: where time comes from.
        config: the router's configuration (``results_buffer``,
            ``receive_batch_frames``).
    """

    def __init__(
        self,
        transport: Transport,
        placement: Placement,
        rejections: Rejections,
        *,
        clock: Clock,
        config: RouterConfig,
    ) -> None:
        self._transport = transport
        self._placement = placement
        self._rejections = rejections
        self._clock = clock
        self._max_frames = config.receive_batch_frames
        self._outbox: list[RoutedResult] = []
        send, receive = anyio.create_memory_object_stream[RoutedResult](config.results_buffer)
        self._send = send
        self.stream = receive
        """Completions in arrival order; the consumer's end."""

    def on_results(self, w: WorkerState, results: Sequence[wire.ItemResult], now: float) -> None:
        """``w`` handed ``results`` back (in one frame): apply each, keep the
        completions for the consumer, then let ``w`` take more work."""
        on_result, outbox = self._placement.on_result, self._outbox
        for r in results:
            try:
                completion = on_result(w, r, now)
            except RoutingError as e:
                self._rejections.add("stale", str(e))
                continue
            if completion is not None:
                outbox.append(completion)
        self._placement.after_results(w, now)
        w.after_results()

    async def receive_loop(self, sessions: Sessions) -> None:
        """Read frames in batches and dispatch them through ``sessions``, delivering
        each batch's completions before reading the next; runs until cancelled."""
        while True:
            frames = await self._transport.receive_batch(self._max_frames)
            sessions.dispatch(frames, self._clock.now())
            if self._outbox:
                await self._deliver(sessions)

    async def _deliver(self, sessions: Sessions) -> None:
        outbox, self._outbox = self._outbox, []
        send = self._send
        for i, completion in enumerate(outbox):
            try:
                send.send_nowait(completion)
            except anyio.WouldBlock:
                # The consumer is slow: stop reading frames (so workers slow down) and
                # do not count the silence this causes against anyone's liveness.
                sessions.stalled = True
                try:
                    for c in outbox[i:]:
                        await send.send(c)
                finally:
                    sessions.stalled = False
                    sessions.resumed_s = self._clock.now()
                return

    def hand_back(self, result: RoutedResult) -> None:
        """Deliver ``result``, which no worker will send (a withdrawn item whose worker
        failed): now if the consumer's stream has room, else with the next batch."""
        try:
            self._send.send_nowait(result)
        except anyio.WouldBlock:
            self._outbox.append(result)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the router is closing: nobody reads results any more

    async def receive_batch(self, max_items: int) -> list[RoutedResult]:
        """Wait for at least one completion; return up to ``max_items`` of those
        already waiting."""
        out = [await self.stream.receive()]
        try:
            while len(out) < max_items:
                out.append(self.stream.receive_nowait())
        except anyio.WouldBlock:
            pass
        return out

    def close(self) -> None:
        """Close both ends of the stream."""
        self._send.close()
        self.stream.close()
