"""The request queue in front of each engine: bounded, closable, observable, ordered
by a request-order policy with an aging bound on top.

The order (:mod:`dynarl.data.request_order`: FIFO, or tool-call priority) decides
who is served next; the aging bound guarantees that nothing starves: when the oldest
waiting request has waited longer than ``factor`` times the mean wait (and at least
``floor_s``), it is served first, oldest first among the overdue. The reference design
has no such bound and can starve fresh requests behind a stream of later turns.

The API follows anyio's memory object streams: ``put_nowait`` / ``get_nowait`` are
the synchronous fast path (``anyio.WouldBlock`` when full / empty), ``put`` / ``get``
wait, ``close`` ends the queue (``get`` drains what is left, then raises
``anyio.EndOfStream``; ``put`` raises ``anyio.ClosedResourceError``), and
``statistics()`` reports depth, waits and how often the bound overrode the order.
"""

import heapq
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import anyio
import msgspec

from dynarl.core.clock import Clock
from dynarl.core.errors import ConfigError
from dynarl.data.request_order import FifoOrder, RequestOrder
from dynarl.data.tally import Tally


class Prioritized(Protocol):
    """What the queue reads from a request to order it."""

    @property
    def tool_calls(self) -> int:
        """Tool calls the request has completed."""
        ...

    @property
    def prefix_tokens(self) -> int:
        """Length of its cached, reusable KV prefix."""
        ...


T = TypeVar("T", bound=Prioritized)


class AgingBound(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """No request waits longer than ``max(floor_s, factor x mean wait)`` while the
    queue is being served.

    Attributes:
        factor: multiple of the mean wait a request may wait before it is served ahead
            of the order.
        floor_s: the bound never drops below this, so a queue that has only seen short
            waits does not degrade to FIFO at the first backlog.
        window: the mean wait is over about the last ``window`` served requests
            (exponentially weighted).
    """

    factor: float = 4.0
    floor_s: float = 0.5
    window: int = 256

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ConfigError(
                f"aging factor must be >= 1 (a multiple of the mean wait), not {self.factor}",
                field="aging.factor",
            )
        if self.floor_s < 0.0 or self.window < 1:
            raise ConfigError("aging floor_s must be >= 0 and window >= 1", field="aging")


DEFAULT_AGING = AgingBound()
"""The aging bound queues get unless told otherwise."""


class QueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one queue.

    ``num_aged`` counts the starvation-bound hits: requests served ahead of the order
    because they had waited past ``age_bound_s``.
    """

    order: str
    depth: int
    max_size: int
    num_put: int
    num_got: int
    mean_wait_s: float
    max_wait_s: float
    age_bound_s: float
    num_aged: int
    num_waiting_getters: int
    num_waiting_putters: int
    closed: bool


class _Entry(Generic[T]):
    """A queued request; implements ``RequestInfo`` for the order policy."""

    __slots__ = ("enqueued_s", "item", "seq", "taken")

    def __init__(self, item: T, enqueued_s: float, seq: int) -> None:
        self.item = item
        self.enqueued_s = enqueued_s
        self.seq = seq
        self.taken = False

    @property
    def tool_calls(self) -> int:
        return self.item.tool_calls

    @property
    def prefix_tokens(self) -> int:
        return self.item.prefix_tokens


class RequestQueue(Generic[T]):
    """A bounded queue of requests served in ``order``, with an aging bound.

    Args:
        order: the request-order policy (FIFO and priority are two policies of this
            one queue).
        max_size: ``put`` waits (``put_nowait`` raises) while this many are queued.
        clock: where waits are measured.
        aging: the starvation bound; ``None`` disables it (the reference behaviour,
            for comparisons only).
    """

    def __init__(
        self,
        order: RequestOrder,
        *,
        max_size: int,
        clock: Clock,
        aging: AgingBound | None = DEFAULT_AGING,
    ) -> None:
        if max_size < 1:
            raise ConfigError(f"a request queue needs max_size >= 1, not {max_size}")
        self.order = order
        # FIFO's key is arrival order: the arrival deque alone serves it, no heap needed.
        self._fifo = isinstance(order, FifoOrder)
        self.max_size = max_size
        self.aging = aging
        self._clock = clock
        self._heap: list[tuple[tuple[float, ...], int, _Entry[T]]] = []
        self._arrivals: deque[_Entry[T]] = deque()
        self._depth = 0
        self._tally = Tally()
        self._seq = 0
        self._getters: deque[anyio.Event] = deque()
        self._putters: deque[anyio.Event] = deque()
        self._closed = False
        self._num_got = 0
        self._mean_wait_s = 0.0
        self._max_wait_s = 0.0
        self._num_aged = 0

    def __len__(self) -> int:
        return self._depth

    def count_in(self, tally: Tally | None) -> None:
        """Count this queue's requests in ``tally`` too, from now on (``None``: in no
        shared tally), moving them out of the one they were counted in."""
        self._tally.count -= self._depth
        self._tally = Tally() if tally is None else tally
        self._tally.count += self._depth

    @property
    def age_bound_s(self) -> float:
        """How long the oldest request may wait before it is served ahead of the order
        (``inf`` without an aging bound)."""
        if self.aging is None:
            return float("inf")
        return max(self.aging.floor_s, self.aging.factor * self._mean_wait_s)

    # ---------------------------------------------------------------- put

    def put_nowait(self, item: T, *, now_s: float | None = None) -> None:
        """Queue ``item`` now; ``anyio.WouldBlock`` if full, ``anyio.ClosedResourceError``
        if closed. ``now_s`` saves a clock read when the caller has just read it."""
        if self._closed:
            raise anyio.ClosedResourceError
        if self._depth >= self.max_size:
            raise anyio.WouldBlock
        entry = _Entry(item, self._clock.now() if now_s is None else now_s, self._seq)
        self._seq += 1
        if not self._fifo:
            heapq.heappush(self._heap, (self.order.key(entry), entry.seq, entry))
        self._arrivals.append(entry)
        self._depth += 1
        self._tally.count += 1
        if self._getters:
            self._getters.popleft().set()

    async def put(self, item: T) -> None:
        """Queue ``item``, waiting while the queue is full."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.put_nowait(item)
                return
            except anyio.WouldBlock:
                await self._wait(self._putters)

    # ---------------------------------------------------------------- get

    def get_nowait(self) -> T:
        """The next request; ``anyio.WouldBlock`` if empty, ``anyio.EndOfStream`` if
        empty and closed."""
        if not self._depth:
            if self._closed:
                raise anyio.EndOfStream
            raise anyio.WouldBlock
        return self._take(self._clock.now())

    def get_batch_nowait(self, max_items: int) -> list[T]:
        """Up to ``max_items`` next requests (possibly none), in the order ``get_nowait``
        would return them, with one clock read."""
        now_s = self._clock.now()
        return [self._take(now_s) for _ in range(min(max_items, self._depth))]

    def _take(self, now_s: float) -> T:
        arrivals = self._arrivals
        while arrivals[0].taken:
            arrivals.popleft()
        if self._fifo:
            entry = arrivals.popleft()
        else:
            oldest = arrivals[0]
            heap = self._heap
            while heap[0][2].taken:
                heapq.heappop(heap)
            if oldest is not heap[0][2] and now_s - oldest.enqueued_s > self.age_bound_s:
                arrivals.popleft()
                entry = oldest
                self._num_aged += 1
            else:
                entry = heapq.heappop(heap)[2]
        entry.taken = True
        self._depth -= 1
        self._tally.count -= 1
        if len(self._heap) > 2 * self._depth + 64 or len(arrivals) > 2 * self._depth + 64:
            self._compact()
        wait_s = now_s - entry.enqueued_s
        self._num_got += 1
        window = self.aging.window if self.aging is not None else 256
        self._mean_wait_s += (wait_s - self._mean_wait_s) / min(self._num_got, window)
        self._max_wait_s = max(self._max_wait_s, wait_s)
        if self._putters:
            self._putters.popleft().set()
        return entry.item

    async def get(self) -> T:
        """The next request, waiting while the queue is empty; ``anyio.EndOfStream``
        once it is closed and empty."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return self.get_nowait()
            except anyio.WouldBlock:
                await self._wait(self._getters)

    def queued(self) -> list[T]:
        """Every queued request, oldest first (a snapshot; nothing is taken)."""
        return [e.item for e in self._arrivals if not e.taken]

    def take_oldest(self, eligible: Callable[[T], bool]) -> T | None:
        """Remove and return the oldest queued request ``eligible`` accepts (``None`` if
        none does), to route it elsewhere. Not counted as served."""
        arrivals = self._arrivals
        while arrivals and arrivals[0].taken:  # taken ones ahead of the oldest left
            arrivals.popleft()
        for entry in arrivals:
            if not entry.taken and eligible(entry.item):
                entry.taken = True
                self._depth -= 1
                self._tally.count -= 1
                if self._putters:
                    self._putters.popleft().set()
                return entry.item
        return None

    def take_matching(self, chosen: Callable[[T], bool]) -> list[T]:
        """Remove and return every queued request ``chosen`` accepts, oldest first (to
        take them out of the run, such as a partial rollout's unfinished requests).
        Not counted as served; the others keep their place and their wait."""
        taken = []
        for entry in self._arrivals:
            if not entry.taken and chosen(entry.item):
                entry.taken = True
                taken.append(entry.item)
        self._depth -= len(taken)
        self._tally.count -= len(taken)
        for _ in range(min(len(taken), len(self._putters))):
            self._putters.popleft().set()
        if taken:
            self._compact()
        return taken

    def take_all(self) -> list[T]:
        """Remove and return every queued request, oldest first (to route them
        elsewhere). Not counted as served."""
        items = [e.item for e in self._arrivals if not e.taken]
        self._heap.clear()
        self._arrivals.clear()
        self._tally.count -= self._depth
        self._depth = 0
        while self._putters:
            self._putters.popleft().set()
        return items

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """No more puts; waiting getters drain what is left, then see the end."""
        self._closed = True
        for waiters in (self._getters, self._putters):
            while waiters:
                waiters.popleft().set()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def statistics(self) -> QueueStatistics:
        """Depth, waits and starvation-bound hits so far."""
        return QueueStatistics(
            order=self.order.name,
            depth=self._depth,
            max_size=self.max_size,
            num_put=self._seq,
            num_got=self._num_got,
            mean_wait_s=self._mean_wait_s,
            max_wait_s=self._max_wait_s,
            age_bound_s=self.age_bound_s,
            num_aged=self._num_aged,
            num_waiting_getters=len(self._getters),
            num_waiting_putters=len(self._putters),
            closed=self._closed,
        )

    # ---------------------------------------------------------------- internals

    async def _wait(self, waiters: deque[anyio.Event]) -> None:
        event = anyio.Event()
        waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():
                # We were woken but will not act on it: pass the wake-up on.
                if waiters:
                    waiters.popleft().set()
            else:
                waiters.remove(event)
            raise

    def _compact(self) -> None:
        """Drop served entries left behind by lazy deletion once they outnumber the
        live ones, so memory stays proportional to the depth."""
        self._heap = [t for t in self._heap if not t[2].taken]
        heapq.heapify(self._heap)
        self._arrivals = deque(e for e in self._arrivals if not e.taken)
