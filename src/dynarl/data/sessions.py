"""The router's sessions with its workers: hello, liveness and the dispatch of frames.

:class:`Sessions` accepts a worker at hello (refusing another protocol version, a
duplicate instance id or an invalid capacity in words), decodes every incoming frame
and dispatches it by message type, answers correlated calls
(:mod:`dynarl.data.calls`), pings every worker and declares one failed after
``liveness_timeout_s`` of silence or when its connection is gone. What a session
carries — items and their results — belongs to the router
(:mod:`dynarl.data.router`), which it calls back.
"""

import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec

from dynarl.control import events as ev
from dynarl.core.clock import Clock
from dynarl.data import wire
from dynarl.data.calls import Calls
from dynarl.data.codec import Codec, Rejections, peek_hello_version
from dynarl.data.errors import PeerUnreachableError
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import RequestOrder
from dynarl.data.transport import PeerId, Transport

logger = logging.getLogger(__name__)

DEPARTED_MEMORY = 4096
"""How many departed peers (retired, or said goodbye) the sessions remember, so that
frames already on their way when they left are dropped quietly."""

_Handler = Callable[[PeerId, WorkerState | None, Any, float], None]
OnResults = Callable[[WorkerState, Sequence[wire.ItemResult], float], None]
"""Receives the results a connected worker handed back (in one frame)."""


class Sessions:
    """The connected workers, by peer, and the frames they send.

    Args:
        transport: the controller's end.
        codec: decodes workers' frames; counts bad ones in its rejections.
        config: the router's configuration (timeouts, queue sizes).
        order: the request order of each new worker's queue.
        clock: where time comes from.
        placement: the router's item table (workers join and fail there).
        on_join: a worker said hello and was accepted (start feeding it).
        on_results: a worker handed items back.
        token: the run's token every hello must carry (``None``: none is asked for).
    """

    def __init__(
        self,
        transport: Transport,
        codec: Codec[wire.AnyToController],
        *,
        config: RouterConfig,
        order: RequestOrder,
        clock: Clock,
        placement: Placement,
        on_join: Callable[[WorkerState], None],
        on_results: OnResults,
        token: str | None = None,
    ) -> None:
        self._transport = transport
        self._token = None if token is None else token.encode()
        self._codec = codec
        self._config = config
        self._order = order
        self._clock = clock
        self._placement = placement
        self._on_join = on_join
        self._on_results_cb = on_results
        self.rejections: Rejections = codec.rejections
        self.by_peer: dict[PeerId, WorkerState] = {}
        self.calls = Calls()
        """Correlated calls in flight."""
        self.joined = anyio.Event()
        """Set (and replaced by the waiter) whenever a worker joins."""
        self.stalled = False
        """The router is blocked handing results to a slow consumer (reads no frames)."""
        self.resumed_s = float("-inf")
        """When the router last stopped being stalled."""
        self.num_frames_unsent = 0
        self.num_late_frames = 0
        """Frames from a peer after it was retired or said goodbye, dropped."""
        self._departed: OrderedDict[PeerId, None] = OrderedDict()
        self._handlers: dict[type[Any], _Handler] = {
            wire.Hello: self._on_hello,
            wire.Pong: self._on_pong,
            wire.Reply: self._on_reply,
            wire.Done: self._on_done,
            wire.DoneBatch: self._on_done_batch,
            wire.Report: self._on_report,
            wire.Bye: self._on_bye,
        }

    # ------------------------------------------------------------------ frames in

    def dispatch(self, frames: Sequence[tuple[PeerId, bytes]], now: float) -> None:
        """Handle frames just received, in order."""
        codec, by_peer, handlers = self._codec, self.by_peer, self._handlers
        for peer, frame in frames:
            w = by_peer.get(peer)
            if w is not None:
                w.last_seen_s = now
            msg = codec.decode(frame)
            if msg is not None:
                handlers[type(msg)](peer, w, msg, now)
            elif w is None:
                version = peek_hello_version(frame)
                if version is not None and version != wire.PROTOCOL_VERSION:
                    self._refuse_version(peer, version)

    def _on_hello(self, peer: PeerId, w: WorkerState | None, msg: wire.Hello, now: float) -> None:
        if w is not None:
            self.rejections.add("unexpected", f"second hello from {w.instance!r}")
            return
        if msg.protocol != wire.PROTOCOL_VERSION:
            self._refuse_version(peer, msg.protocol)
            return
        if self._token is not None and not hmac.compare_digest(msg.token.encode(), self._token):
            what = "a wrong" if msg.token else "no"
            self.rejections.add(
                "unauthorized", f"hello as {msg.instance!r} with {what} run token (refused)"
            )
            self.send_nowait(
                peer,
                wire.Refused(
                    "auth",
                    f"this worker presented {what} run token: start workers with the "
                    f"endpoint this run's controller gives out (it carries the token)",
                ),
            )
            return
        if msg.instance in self._placement.workers:
            self.send_nowait(
                peer,
                wire.Refused(
                    "duplicate",
                    f"instance {msg.instance!r} is already connected; give each "
                    f"worker its own instance id",
                ),
            )
            return
        if msg.capacity < 1 or msg.slots < 0:
            self.rejections.add(
                "invalid",
                f"hello from {msg.instance!r} with capacity {msg.capacity}, slots {msg.slots}",
            )
            self.send_nowait(peer, wire.Refused("invalid", "capacity must be >= 1 and slots >= 0"))
            return
        cfg = self._config
        w = WorkerState.configured(
            peer,
            instance=msg.instance,
            component=msg.component,
            capacity=msg.capacity,
            slots=msg.slots,
            config=cfg,
            order=self._order,
            clock=self._clock,
            now_s=now,
        )
        self.by_peer[peer] = w
        self._departed.pop(peer, None)
        self._on_join(w)
        self.send_nowait(
            peer,
            wire.Welcome(
                wire.PROTOCOL_VERSION, w.instance, cfg.heartbeat_interval_s, cfg.liveness_timeout_s
            ),
        )
        logger.info(
            "worker %s (%s, capacity %d, slots %d) joined",
            w.instance,
            w.component,
            w.capacity,
            w.slots,
        )
        self._placement.add_worker(w, now)
        self.joined.set()

    def _refuse_version(self, peer: PeerId, version: int) -> None:
        logger.warning(
            "refused a worker speaking protocol version %d (ours: %d)",
            version,
            wire.PROTOCOL_VERSION,
        )
        self.send_nowait(
            peer,
            wire.Refused(
                "version",
                f"this worker speaks data-plane protocol version {version} but the controller "
                f"speaks version {wire.PROTOCOL_VERSION}: install the same dynarl version on "
                f"the controller and the workers",
            ),
        )

    def _unknown(self, peer: PeerId, what: str) -> None:
        if peer in self._departed:
            # A pong or result already on its way when the peer was retired or left:
            # the peer knows it is gone, so nothing is refused or reported.
            self.num_late_frames += 1
            logger.debug("dropped %s from a departed peer", what)
            return
        self.rejections.add("unexpected", f"{what} from a peer that is not a worker")
        self.send_nowait(
            peer,
            wire.Refused(
                "unknown",
                "this worker is not connected (it never said hello, or it was "
                "declared failed): restart it",
            ),
        )

    def _on_pong(self, peer: PeerId, w: WorkerState | None, msg: wire.Pong, now: float) -> None:
        if w is None:
            self._unknown(peer, "a pong")
            return
        self.calls.deliver(w, msg.corr, b"", more=False)

    def _on_reply(self, peer: PeerId, w: WorkerState | None, msg: wire.Reply, now: float) -> None:
        if w is None:
            self._unknown(peer, "a reply")
            return
        self.calls.deliver(w, msg.corr, msg.body, more=msg.more)

    def _on_done(self, peer: PeerId, w: WorkerState | None, msg: wire.Done, now: float) -> None:
        self._on_results(peer, w, (msg.result,), now)

    def _on_done_batch(
        self, peer: PeerId, w: WorkerState | None, msg: wire.DoneBatch, now: float
    ) -> None:
        self._on_results(peer, w, msg.results, now)

    def _on_results(
        self, peer: PeerId, w: WorkerState | None, results: Sequence[wire.ItemResult], now: float
    ) -> None:
        if w is None:
            self._unknown(peer, "results")
            return
        self._on_results_cb(w, results, now)

    def _on_report(self, peer: PeerId, w: WorkerState | None, msg: wire.Report, now: float) -> None:
        if w is None:
            self._unknown(peer, "a report")
            return
        event = msgspec.structs.replace(msg.event, time_s=now)
        if isinstance(event, ev.EngineStats) and event.instance == w.instance:
            w.kv_usage = event.kv_usage
        self._placement.emit(event)

    def _on_bye(self, peer: PeerId, w: WorkerState | None, msg: wire.Bye, now: float) -> None:
        if w is None:
            self._unknown(peer, "a bye")
            return
        self.fail(w, f"it left ({msg.reason or 'no reason given'})", now)
        self._remember_departed(peer)

    # ------------------------------------------------------------------ frames out

    async def send(self, w: WorkerState, msg: wire.ToWorker) -> None:
        """Send ``msg`` to ``w``, waiting while its pipe is full; a vanished peer is
        declared failed."""
        try:
            await self._transport.send(w.peer, self._codec.encode(msg))
        except PeerUnreachableError:
            self.fail(w, "its connection is gone", self._clock.now())

    def send_nowait(self, peer: PeerId, msg: wire.ToWorker) -> None:
        """Send a control frame now, or count it as unsent (pipe full, peer gone)."""
        try:
            self._transport.send_nowait(peer, self._codec.encode(msg))
        except (anyio.WouldBlock, PeerUnreachableError):
            self.num_frames_unsent += 1

    # ------------------------------------------------------------------ liveness

    async def heartbeat_loop(self) -> None:
        """Ping every worker each ``heartbeat_interval_s``; fail the silent ones."""
        cfg = self._config
        while True:
            await self._clock.sleep(cfg.heartbeat_interval_s)
            now = self._clock.now()
            ping = self._codec.encode(wire.Ping(0))
            for w in list(self.by_peer.values()):
                # While stalled on a slow consumer we read nothing, so silence proves
                # nothing; we keep pinging so that workers do not give up on us either.
                silent_s = now - max(w.last_seen_s, self.resumed_s)
                if silent_s > cfg.liveness_timeout_s and not self.stalled:
                    self.fail(
                        w,
                        f"silent for {silent_s:.2f} s "
                        f"(liveness_timeout_s={cfg.liveness_timeout_s})",
                        now,
                    )
                    continue
                try:
                    self._transport.send_nowait(w.peer, ping)
                except anyio.WouldBlock:
                    pass  # it is not reading; its silence will tell
                except PeerUnreachableError:
                    self.fail(w, "its connection is gone", now)

    def fail(self, w: WorkerState, reason: str, now: float) -> None:
        """Declare ``w`` failed; its items are routed elsewhere."""
        if self.by_peer.get(w.peer) is not w:
            return  # already gone
        self._release(w)
        self._placement.fail_worker(w, reason, now)

    def forget(self, w: WorkerState) -> None:
        """Drop ``w``, which holds nothing, without reporting a failure (it is being
        retired: frames it still sends are dropped quietly)."""
        self._release(w)
        items = self._placement.remove_worker(w)
        assert not items, "only workers that hold nothing are forgotten"
        self._remember_departed(w.peer)

    def _remember_departed(self, peer: PeerId) -> None:
        self._departed[peer] = None
        self._departed.move_to_end(peer)
        if len(self._departed) > DEPARTED_MEMORY:
            self._departed.popitem(last=False)

    def _release(self, w: WorkerState) -> None:
        del self.by_peer[w.peer]
        w.scope.cancel()
        w.idle.set()
        self.calls.fail_worker(w)
