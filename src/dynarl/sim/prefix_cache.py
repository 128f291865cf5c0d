"""An engine's prefix cache, by tokens: the KV of requests away on a tool call.

Entries are evictable: they yield to running requests, least recently used first, and
from the tail (a radix cache frees leaves first), so a returning request finds the head
of its context and re-prefills only the rest.
"""

from collections import OrderedDict

from dynarl.core.ids import ItemId


class PrefixCache:
    """Cached context tokens per item, LRU by insertion."""

    def __init__(self) -> None:
        self._entries: OrderedDict[ItemId, int] = OrderedDict()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens held in all."""
        return self._tokens

    def get(self, item: ItemId) -> int:
        """Tokens held for ``item`` (0 if none)."""
        return self._entries.get(item, 0)

    def put(self, item: ItemId, tokens: int) -> None:
        """Hold ``tokens`` of ``item``'s context, as the most recent entry."""
        self.take(item)
        self._entries[item] = tokens
        self._tokens += tokens

    def take(self, item: ItemId) -> int:
        """Remove ``item``'s entry and return its tokens (0 if none)."""
        tokens = self._entries.pop(item, 0)
        self._tokens -= tokens
        return tokens

    def shrink_to(self, limit: int) -> None:
        """Evict until at most ``limit`` tokens remain (least recent entry first, its
        tail first)."""
        excess = self._tokens - max(limit, 0)
        while excess > 0:
            item, tokens = next(iter(self._entries.items()))
            cut = min(tokens, excess)
            if cut == tokens:
                del self._entries[item]
            else:
                self._entries[item] = tokens - cut
            self._tokens -= cut
            excess -= cut
