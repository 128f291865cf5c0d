"""The items a worker holds in flight, in dispatch order, with a count of those it does
not pin (that may move to another instance of its component)."""

from collections.abc import Iterator, ValuesView

from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.tally import Tally


def pinned_to(item: wire.Item, instance: InstanceId) -> bool:
    """Whether ``item`` may not leave ``instance``: it must return there, or
    ``instance`` holds its KV prefix."""
    return item.affinity == "must" or item.instance == instance


class InFlight:
    """A worker's items in flight by id, oldest dispatch first.

    Keeps apart those not :func:`pinned_to` the worker (:meth:`unpinned_newest_first`,
    :attr:`num_unpinned`): only they may move, so a balance looking for one to recall
    never walks past the sessions whose prefix the worker holds (in a multi-turn
    rollout's tail, nearly all it holds); and :attr:`num_added`, which tells the
    balancer whether anything came in since it last found nothing here to take.
    Counts in shared :class:`~dynarl.data.tally.Tally` objects what it holds, and what
    it holds beyond the worker's ``slots`` (:attr:`num_beyond_slots`: waiting in the
    worker's own queue), so a component can tell in O(1) that none of its workers
    holds more than it runs.

    Args:
        owner: the worker's instance.
        slots: the items the worker runs at once (0: no limit, none ever waits).
    """

    __slots__ = ("_beyond", "_items", "_tally", "_unpinned", "num_added", "owner", "slots")

    def __init__(self, owner: InstanceId, slots: int = 0) -> None:
        self.owner = owner
        self.slots = slots
        self._items: dict[ItemId, wire.Item] = {}
        self._unpinned: dict[ItemId, wire.Item] = {}  # the movable ones, in dispatch order
        self.num_added = 0
        """Items ever added (a version: what is held here only grows by an add)."""
        self._tally = Tally()
        self._beyond = Tally()

    @property
    def num_beyond_slots(self) -> int:
        """Items held here beyond the worker's slots (0 without a limit)."""
        return max(0, len(self._items) - self.slots) if self.slots > 0 else 0

    @property
    def num_unpinned(self) -> int:
        """Items held here that another instance could take."""
        return len(self._unpinned)

    def unpinned_newest_first(self) -> Iterator[wire.Item]:
        """The items another instance could take, most recently dispatched first (do
        not add or pop while iterating)."""
        return reversed(self._unpinned.values())

    def count_in(self, tally: Tally | None, beyond: Tally | None = None) -> None:
        """Count these items in ``tally`` too, and those beyond the slots in ``beyond``,
        from now on (``None``: in no shared tally), moving them out of the ones they
        were counted in."""
        self._tally.count -= len(self._items)
        self._tally = Tally() if tally is None else tally
        self._tally.count += len(self._items)
        self._beyond.count -= self.num_beyond_slots
        self._beyond = Tally() if beyond is None else beyond
        self._beyond.count += self.num_beyond_slots

    def add(self, item: wire.Item) -> None:
        """``item`` was dispatched to the worker (replacing one of the same id)."""
        self.pop(item.id)
        self._items[item.id] = item
        self._tally.count += 1
        if 0 < self.slots < len(self._items):
            self._beyond.count += 1
        self.num_added += 1
        if not pinned_to(item, self.owner):
            self._unpinned[item.id] = item

    def pop(self, item_id: ItemId) -> wire.Item | None:
        """Take ``item_id`` out (its result came back); ``None`` if not held."""
        item = self._items.pop(item_id, None)
        if item is not None:
            self._tally.count -= 1
            if 0 < self.slots <= len(self._items):
                self._beyond.count -= 1
            self._unpinned.pop(item_id, None)
        return item

    def clear(self) -> None:
        """Forget every item (the worker failed; they are routed again)."""
        self._tally.count -= len(self._items)
        self._beyond.count -= self.num_beyond_slots
        self._items.clear()
        self._unpinned.clear()

    def values(self) -> ValuesView[wire.Item]:
        """The items, oldest dispatch first."""
        return self._items.values()

    def __getitem__(self, item_id: ItemId) -> wire.Item:
        return self._items[item_id]

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __iter__(self) -> Iterator[ItemId]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
