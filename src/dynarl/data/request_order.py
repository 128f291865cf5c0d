"""Request-level scheduling: the order in which an engine's queue serves requests.

An order is a small policy object mapping a request's state to a sort key (smaller is
served first). The priority-aware request queue in front of each engine applies it and
adds the aging bound that keeps any request from starving; these keys carry no age
term beyond arrival order, exactly so that the bound is the queue's one mechanism.
"""

from typing import Literal, Protocol


class RequestInfo(Protocol):
    """What an order may look at for one queued request."""

    @property
    def tool_calls(self) -> int:
        """Tool calls this multi-turn request has completed."""
        ...

    @property
    def prefix_tokens(self) -> int:
        """Tokens of its context an engine holds cached (its reusable KV prefix)."""
        ...

    @property
    def enqueued_s(self) -> float:
        """When it entered the queue."""
        ...


class RequestOrder(Protocol):
    """A request-level policy: ``key(info)`` sorts requests, smallest first."""

    name: str

    def key(self, info: RequestInfo) -> tuple[float, ...]:
        """Sort key of one request; the queue serves the smallest key first."""
        ...


class FifoOrder:
    """First come, first served."""

    name = "fifo"

    def key(self, info: RequestInfo) -> tuple[float, ...]:
        """Arrival time."""
        return (info.enqueued_s,)


class ToolCallPriorityOrder:
    """Priority-aware order for agentic requests.

    More completed tool calls first (later turns are shorter, so this approximates
    shortest-remaining-work and finishes trajectories), then a longer cached prefix
    (serve it before it is evicted), then arrival. Starvation is prevented by the
    queue's aging bound, not here.
    """

    name = "priority"

    def key(self, info: RequestInfo) -> tuple[float, ...]:
        """``(-tool_calls, -prefix_tokens, enqueued_s)``."""
        return (-info.tool_calls, -info.prefix_tokens, info.enqueued_s)


OrderName = Literal["fifo", "priority"]
"""The orders a configuration names (``rollout.request_order``)."""


def order_named(name: OrderName) -> RequestOrder:
    """The request order ``name`` stands for."""
    return ToolCallPriorityOrder() if name == "priority" else FifoOrder()
