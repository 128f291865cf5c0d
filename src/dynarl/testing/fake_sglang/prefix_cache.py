"""What the fake server reports as ``cached_tokens``: an account of SGLang's radix
cache. A request's prefix is looked up at admission (``match_prefix``: the longest
prefix of its input that a finished request's tokens share, all but the last input
token, which is always computed) and its input + output is inserted when it finishes,
aborted ones included (``cache_finished_req``). Flushing the cache (a weight update
with ``flush_cache``, ``/flush_cache``, releasing the KV cache) empties it. Only the
count is faked: the torch engine behind the fake recomputes every prefix."""

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Token sequences a server holds cached, least recently used evicted first.

    Args:
        capacity: sequences kept.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._held: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def match(self, input_ids: Sequence[int]) -> int:
        """Tokens of ``input_ids`` found cached (at most all but the last one)."""
        limit = len(input_ids) - 1
        best: tuple[int, tuple[int, ...]] | None = None
        for held in self._held:
            n = _common_prefix(held, input_ids, limit)
            if best is None or n > best[0]:
                best = (n, held)
        if best is None or best[0] == 0:
            return 0
        self._held.move_to_end(best[1])
        return best[0]

    def insert(self, token_ids: Sequence[int]) -> None:
        """Hold ``token_ids`` (a finished request's input + output)."""
        key = tuple(token_ids)
        self._held[key] = None
        self._held.move_to_end(key)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def flush(self) -> None:
        """Drop everything."""
        self._held.clear()


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
