"""The rollout engine's waiting queue: requests not yet admitted, served in a pluggable
order.

The engine needs only ``put_nowait``, ``get_nowait`` and ``len`` (anyio's memory-stream
names), so the priority-aware queue with aging, ``dynarl.data.request_queue.RequestQueue``,
can replace :class:`OrderedWaitingList` unchanged.
Aborting a waiting request does not touch the queue: the engine forgets it and skips it
when it comes out.
"""

import heapq
import itertools
from typing import Generic, Protocol, TypeVar

import anyio

from dynarl.data.request_order import RequestInfo, RequestOrder

T = TypeVar("T", bound=RequestInfo)


class WaitingQueue(Protocol[T]):
    """What the engine needs of its waiting queue."""

    def put_nowait(self, item: T) -> None:
        """Add ``item``; it is served in the queue's order. A bounded queue that is full
        raises ``anyio.WouldBlock``."""
        ...

    def get_nowait(self) -> T:
        """Remove and return the item to serve next; raise ``anyio.WouldBlock`` if empty."""
        ...

    def __len__(self) -> int:
        """Items in the queue."""
        ...


class OrderedWaitingList(Generic[T]):
    """A heap ordered by a :class:`RequestOrder`'s key, ties broken by insertion.

    Unbounded. Keys are computed once, at ``put_nowait``: the orders' inputs (tool
    calls, cached prefix, arrival time) do not change while a request waits here.
    """

    def __init__(self, order: RequestOrder) -> None:
        self._order = order
        self._heap: list[tuple[tuple[float, ...], int, T]] = []
        self._counter = itertools.count()

    @property
    def order(self) -> RequestOrder:
        """The order items are served in."""
        return self._order

    def put_nowait(self, item: T) -> None:
        """Add ``item``."""
        heapq.heappush(self._heap, (self._order.key(item), next(self._counter), item))

    def get_nowait(self) -> T:
        """The item with the smallest key; ``anyio.WouldBlock`` when empty."""
        if not self._heap:
            raise anyio.WouldBlock
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        """Items waiting."""
        return len(self._heap)
