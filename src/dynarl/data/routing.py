"""Routing policy: which instance serves an item, by its affinity and by load.

A policy is pure and synchronous: it gets the item, the instance that served it before
(if that instance is still active for the item's edge) and the active candidates, and
returns the chosen one or ``None`` (every candidate's queue is full: the item waits in
the router's backlog). The router applies the decision and reports it as an event.
"""

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

from dynarl.data.wire import Item


class Target(Protocol):
    """What a policy reads about one candidate instance."""

    @property
    def load(self) -> float:
        """Items queued and in flight per unit of capacity."""
        ...

    @property
    def has_room(self) -> bool:
        """Whether it can take a returning session without hurting it (short queue,
        KV cache not full)."""
        ...

    @property
    def is_full(self) -> bool:
        """Whether its request queue is full."""
        ...

    @property
    def is_idle(self) -> bool:
        """Whether it holds nothing (no item in flight or queued)."""
        ...

    @property
    def can_start_now(self) -> bool:
        """Whether an item routed to it now starts at once."""
        ...


T = TypeVar("T", bound=Target)


class RoutingPolicy(Protocol):
    """Chooses an instance for an item."""

    name: str

    def select(self, item: Item, previous: T | None, candidates: Sequence[T]) -> T | None:
        """The instance to serve ``item``, or ``None`` if none can take it now.

        ``previous`` is the instance that served it before, if it is still an active
        candidate; ``candidates`` are the active instances consuming its edge.
        """
        ...


class AffinityRouting:
    """Affinity first, then power-of-two choices on load.

    ``must`` items return to their previous instance whenever it is active (they wait
    for it when its queue is full); ``prefer`` items return while it has room (a
    multi-turn session keeps its KV prefix) — unless it cannot start them now while
    another candidate sits idle: an idle instance's time is worth the re-prefill, while
    the busy one would only queue the item (or add it to a memory-bound batch);
    everything else, and any item whose previous instance is gone, goes to the less
    loaded of two random candidates with queue space.

    Args:
        seed: seed of the random choices (deterministic routing in tests and the
            simulator).
    """

    name = "affinity"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def select(self, item: Item, previous: T | None, candidates: Sequence[T]) -> T | None:
        """See :meth:`RoutingPolicy.select`."""
        if previous is not None:
            if item.affinity == "must":
                return None if previous.is_full else previous
            if item.affinity == "prefer" and previous.has_room and not previous.is_full:
                if previous.can_start_now:
                    return previous
                idle = next((c for c in candidates if c.is_idle), None)
                return previous if idle is None else idle
        n = len(candidates)
        if n == 0:
            return None
        if n == 1:
            only = candidates[0]
            return None if only.is_full else only
        rand = self._rng.random
        i = int(rand() * n)
        j = int(rand() * (n - 1))
        a, b = candidates[i], candidates[j + (j >= i)]
        best = a if a.load <= b.load else b
        if not best.is_full:
            return best
        other = b if best is a else a
        if not other.is_full:
            return other
        free = [c for c in candidates if not c.is_full]
        return min(free, key=lambda c: c.load) if free else None
