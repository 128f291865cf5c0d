"""The instances of one component, as the placement routes and balances among them.

After every batch of results the placement asks whether another instance of the
result's component queues work the one with room could take, and whether that one
holds less than its fair share of what they all hold. :class:`ComponentPeers` answers
both without visiting each instance while nothing can move: it keeps the active
instances and their capacity (refreshed as workers join, leave, drain or resume) and
three :class:`~dynarl.data.tally.Tally` counts, of what every instance of the component
(draining ones too) queues, holds in flight, and holds in flight beyond its slots.
"""

from collections.abc import Iterable

from dynarl.data.peers import WorkerState
from dynarl.data.tally import Tally


class ComponentPeers:
    """One component's workers: the active ones, their capacity, and what all hold."""

    __slots__ = ("active", "beyond_slots", "in_flight", "queued", "slots")

    def __init__(self) -> None:
        self.active: list[WorkerState] = []
        """Its active workers (routed to), in the order they joined."""
        self.slots = 0
        """Their capacity, summed."""
        self.queued = Tally()
        """Items queued at any of its workers, active or draining."""
        self.in_flight = Tally()
        """Items in flight at any of its workers, active or draining."""
        self.beyond_slots = Tally()
        """Of those, the items beyond their workers' slots (waiting in the workers' own
        queues)."""

    @classmethod
    def of(cls, workers: Iterable[WorkerState]) -> "ComponentPeers":
        """The peers of ``workers`` (all of one component), each counted and active."""
        peers = cls()
        for w in workers:
            peers.count(w)
        peers.refresh(workers)
        return peers

    def count(self, w: WorkerState) -> None:
        """``w`` joined: count what it queues and holds in flight."""
        w.queue.count_in(self.queued)
        w.in_flight.count_in(self.in_flight, self.beyond_slots)

    def uncount(self, w: WorkerState) -> None:
        """``w`` left: stop counting it."""
        w.queue.count_in(None)
        w.in_flight.count_in(None)

    def refresh(self, workers: Iterable[WorkerState]) -> None:
        """The component's workers changed, or one drained or resumed: keep the active
        ones of ``workers`` (the component's, in join order)."""
        self.active = [w for w in workers if w.active]
        self.slots = sum(w.slots for w in self.active)

    @property
    def held_at_most(self) -> int:
        """What all its workers hold, queued and in flight (draining ones too): never
        less than what its active ones hold together."""
        return self.queued.count + self.in_flight.count
