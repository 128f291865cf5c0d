"""The router's record of one connected worker, and its configuration and statistics.

:class:`WorkerState` is what the router knows about a worker: its instance, capacity,
request queue, items in flight, liveness and load (it is the routing policy's
:class:`~dynarl.data.routing.Target`). The router owns and mutates it.
"""

from typing import Annotated, Literal

import anyio
import msgspec

from dynarl.core.clock import Clock
from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import wire
from dynarl.data.codec import DEFAULT_MAX_FRAME_BYTES
from dynarl.data.in_flight import InFlight
from dynarl.data.request_order import RequestOrder
from dynarl.data.request_queue import DEFAULT_AGING, AgingBound, QueueStatistics, RequestQueue
from dynarl.data.transport import PeerId, TransportStatistics


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The data router's section of the configuration.

    Attributes:
        heartbeat_interval_s: how often each worker is pinged.
        liveness_timeout_s: a worker silent this long is declared failed and its items
            are routed elsewhere.
        max_frame_bytes: larger frames are rejected unread.
        max_batch_items: most items in one ``WorkBatch`` frame.
        max_queued_per_instance: size of each instance's request queue.
        max_backlog_items: items no instance can take now wait here; ``submit`` waits
            while it is full.
        sticky_max_queued: a ``prefer`` session returns to its instance only while that
            instance's queue is shorter than this.
        kv_full: ... and while its reported KV usage is below this.
        aging: the request queues' starvation bound (``None``: none, for comparisons).
        balance_on_join: an instance that joins or resumes takes its fair share (by
            capacity) of what the others of its component hold, queued items first,
            then in-flight ones recalled with their partial output
            (``Placement.balance_for``); off, it takes only the backlog and what waits
            beyond another's capacity.
        balance_below_share: so does an instance that gets results back while it
            holds less than its fair share (the rollout tail: the long requests spread
            over the engines that finished theirs, each moved this way at most once).
        results_buffer: completions buffered for the caller before the router stops
            reading frames.
        receive_batch_frames: most frames handled per wake-up of the receive loop.
    """

    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    liveness_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024)] = DEFAULT_MAX_FRAME_BYTES
    max_batch_items: Annotated[int, msgspec.Meta(ge=1)] = 256
    max_queued_per_instance: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_backlog_items: Annotated[int, msgspec.Meta(ge=1)] = 65536
    sticky_max_queued: Annotated[int, msgspec.Meta(ge=1)] = 64
    kv_full: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    aging: AgingBound | None = DEFAULT_AGING
    balance_on_join: bool = True
    balance_below_share: bool = True
    results_buffer: Annotated[int, msgspec.Meta(ge=1)] = 65536
    receive_batch_frames: Annotated[int, msgspec.Meta(ge=1)] = 256


class RouterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the router.

    Items are pending from ``submit`` to completion: in the backlog, queued at an
    instance, in flight on a worker, or out on a tool call. ``rejected`` counts bad
    input by kind (see :data:`dynarl.data.codec.REJECT_KINDS`; ``framing`` for
    transport-level drops); ``num_refused`` counts items workers refused to serve
    (finished, not routed again); ``num_stolen`` counts queued items an idle instance
    took from another's queue (also counted in ``num_requeued``); ``num_balanced``
    counts items moved to a joining instance (``RouterConfig.balance_on_join``);
    ``num_frames_unsent`` counts control frames (pings, refusals) dropped because the
    peer was not reading or gone; ``num_late_frames`` counts frames (a pong, results)
    that arrived from a worker after it was retired or said goodbye, dropped without a
    rejection.
    """

    num_workers: int
    num_active: int
    num_pending: int
    num_backlog: int
    num_queued: int
    num_in_flight: int
    num_in_tool: int
    num_routed: int
    num_completed: int
    num_refused: int
    num_requeued: int
    num_stolen: int
    num_balanced: int
    num_workers_failed: int
    num_frames_unsent: int
    num_late_frames: int
    rejected: dict[str, int]
    transport: TransportStatistics
    queues: dict[InstanceId, QueueStatistics]


Balance = Literal["below_share", "on_join", "none"]
"""How much the router balances (``rollout.balance``): on joining and below the fair
share, on joining only, or not at all."""

_BALANCE_RULES: dict[str, tuple[bool, bool]] = {
    "below_share": (True, True),
    "on_join": (True, False),
    "none": (False, False),
}


def with_balance(config: RouterConfig, balance: Balance) -> RouterConfig:
    """``config`` with the balancing ``balance`` names (``balance_on_join``,
    ``balance_below_share``).

    Raises:
        ValueError: ``balance`` is not a :data:`Balance`.
    """
    try:
        on_join, below_share = _BALANCE_RULES[balance]
    except KeyError:
        raise ValueError(f"balance={balance!r}: one of {sorted(_BALANCE_RULES)}") from None
    return msgspec.structs.replace(config, balance_on_join=on_join, balance_below_share=below_share)


class WorkerState:
    """One connected worker as the router sees it."""

    __slots__ = (
        "active",
        "capacity",
        "component",
        "credit",
        "idle",
        "in_flight",
        "instance",
        "kv_full",
        "kv_usage",
        "last_seen_s",
        "peer",
        "queue",
        "scope",
        "slots",
        "sticky_max_queued",
    )

    def __init__(
        self,
        peer: PeerId,
        *,
        instance: InstanceId,
        component: ComponentId,
        capacity: int,
        queue: RequestQueue[wire.Item],
        now_s: float,
        sticky_max_queued: int,
        kv_full: float,
        slots: int = 0,
    ) -> None:
        self.peer = peer
        self.instance = instance
        self.component = component
        self.capacity = capacity
        """Items it takes at once (sent to it, not yet back): what the pump fills."""
        self.slots = min(slots, capacity) if slots > 0 else capacity
        """Items it runs at once; what it holds beyond them waits (in its own queue or
        here). Routing, balance and stealing read this."""
        self.queue = queue
        self.in_flight = InFlight(instance, self.slots)
        self.active = True
        self.last_seen_s = now_s
        self.kv_usage = 0.0
        self.sticky_max_queued = sticky_max_queued
        self.kv_full = kv_full
        self.credit = anyio.Event()
        self.idle = anyio.Event()
        self.scope = anyio.CancelScope()

    @classmethod
    def configured(
        cls,
        peer: PeerId,
        *,
        instance: InstanceId,
        component: ComponentId,
        capacity: int,
        config: "RouterConfig",
        order: RequestOrder,
        clock: Clock,
        now_s: float,
        slots: int = 0,
    ) -> "WorkerState":
        """A worker that joins now, with a fresh queue in ``order``: its size, aging,
        stickiness and KV threshold as the router's ``config`` says; it takes
        ``capacity`` items at once and runs ``slots`` of them (0: all)."""
        queue: RequestQueue[wire.Item] = RequestQueue(
            order, max_size=config.max_queued_per_instance, clock=clock, aging=config.aging
        )
        return cls(
            peer,
            instance=instance,
            component=component,
            capacity=capacity,
            queue=queue,
            now_s=now_s,
            sticky_max_queued=config.sticky_max_queued,
            kv_full=config.kv_full,
            slots=slots,
        )

    @property
    def load(self) -> float:
        """Items queued and in flight per slot."""
        return (len(self.in_flight) + len(self.queue)) / self.slots

    @property
    def has_room(self) -> bool:
        """A returning session may come back: short queue, KV cache not full."""
        return len(self.queue) < self.sticky_max_queued and self.kv_usage < self.kv_full

    @property
    def is_full(self) -> bool:
        """Its request queue is full."""
        return len(self.queue) >= self.queue.max_size

    @property
    def is_idle(self) -> bool:
        """It holds nothing: no item in flight or queued."""
        return not self.in_flight and not len(self.queue)

    @property
    def can_start_now(self) -> bool:
        """An item routed to it now starts at once: what it has queued and in flight
        leaves a slot free."""
        return len(self.in_flight) + len(self.queue) < self.slots

    @property
    def num_waiting(self) -> int:
        """Items it holds (queued here or in flight) that cannot start until something
        running finishes."""
        return max(0, len(self.in_flight) + len(self.queue) - self.slots)

    def after_results(self) -> None:
        """Results came back: wake the pump if it waits for capacity; note idleness."""
        self.credit.set()
        self.check_idle()

    def check_idle(self) -> None:
        """Set :attr:`idle` once a draining worker holds nothing."""
        if not self.active and not self.in_flight and not len(self.queue):
            self.idle.set()
