"""A modelled engine's waiting queue, in the request order a real engine serves.

A real rollout engine holds a queue of its own: the data router hands a worker up to
its slot's capacity (:data:`~dynarl.workers.config.SLOT_CAPACITY` items), beyond the
engine's running batch. The torch engine serves that queue in the run's request order
(:mod:`~dynarl.data.request_order`) and SGLang by each request's priority, which the
worker sets from the same order. So queued jobs come out by their ``rank`` (the order's
key when they reached the engine; all equal under FIFO), then arrival; a job retracted
from the running batch goes back in front of the jobs of its rank.
"""

import heapq
from collections.abc import Iterable

from dynarl.core.ids import ItemId
from dynarl.sim.jobs import EngineEntry


class EngineQueue:
    """Queued jobs of one modelled engine, smallest ``(rank, arrival)`` first."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], int, EngineEntry]] = []
        self._ids: set[ItemId] = set()
        self._back = 0  # arrivals so far (the next one's place)
        self._front = 0  # jobs put back in front so far (the next one's place: -1 - this)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, item: ItemId) -> bool:
        return item in self._ids

    @property
    def ids(self) -> frozenset[ItemId]:
        """The queued jobs' ids."""
        return frozenset(self._ids)

    def push(self, entry: EngineEntry) -> None:
        """Queue a job that arrived (behind the jobs of its rank)."""
        self._back += 1
        self._add(entry, self._back)

    def push_front(self, entry: EngineEntry) -> None:
        """Put back a retracted job, in front of the jobs of its rank."""
        self._front += 1
        self._add(entry, -self._front)

    def peek(self) -> EngineEntry:
        """The job served next (the queue must not be empty)."""
        return self._heap[0][2]

    def pop(self) -> EngineEntry:
        """Take the job served next (the queue must not be empty)."""
        entry = heapq.heappop(self._heap)[2]
        self._ids.discard(entry.job.id)
        return entry

    def remove(self, ids: Iterable[ItemId]) -> list[EngineEntry]:
        """Take out the queued jobs among ``ids`` (others are skipped)."""
        wanted = self._ids.intersection(ids)
        if not wanted:
            return []
        taken = [e for _, _, e in self._heap if e.job.id in wanted]
        self._heap = [t for t in self._heap if t[2].job.id not in wanted]
        heapq.heapify(self._heap)
        self._ids -= wanted
        return taken

    def _add(self, entry: EngineEntry, place: int) -> None:
        heapq.heappush(self._heap, (entry.job.rank, place, entry))
        self._ids.add(entry.job.id)
