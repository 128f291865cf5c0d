"""The items a worker holds in flight, in dispatch order, with a count of those it does
not pin (that may move to another instance of its component)."""

from collections.abc import Iterator, ValuesView

from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire


def pinned_to(item: wire.Item, instance: InstanceId) -> bool:
    """Whether ``item`` may not leave ``instance``: it must return there, or
    ``instance`` holds its KV prefix."""
    return item.affinity == "must" or item.instance == instance


class InFlight:
    """A worker's items in flight by id, oldest dispatch first.

    Keeps :attr:`num_unpinned`, how many of them are not :func:`pinned_to` the worker:
    when it is 0, no balance can take any of them (in a multi-turn rollout's tail
    every session sits on the engine that holds its prefix), which the balancer then
    knows without looking at each; and :attr:`num_added`, which tells the balancer
    whether anything came in since it last found nothing here to take.

    Args:
        owner: the worker's instance.
    """

    __slots__ = ("_items", "num_added", "num_unpinned", "owner")

    def __init__(self, owner: InstanceId) -> None:
        self.owner = owner
        self._items: dict[ItemId, wire.Item] = {}
        self.num_unpinned = 0
        """Items held here that another instance could take."""
        self.num_added = 0
        """Items ever added (a version: what is held here only grows by an add)."""

    def add(self, item: wire.Item) -> None:
        """``item`` was dispatched to the worker (replacing one of the same id)."""
        self.pop(item.id)
        self._items[item.id] = item
        self.num_added += 1
        if not pinned_to(item, self.owner):
            self.num_unpinned += 1

    def pop(self, item_id: ItemId) -> wire.Item | None:
        """Take ``item_id`` out (its result came back); ``None`` if not held."""
        item = self._items.pop(item_id, None)
        if item is not None and not pinned_to(item, self.owner):
            self.num_unpinned -= 1
        return item

    def clear(self) -> None:
        """Forget every item (the worker failed; they are routed again)."""
        self._items.clear()
        self.num_unpinned = 0

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
