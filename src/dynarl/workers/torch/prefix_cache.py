"""The rollout engine's per-session prefix cache: the KV of a multi-turn session's last
turn, kept so its next turn prefills only the new suffix.

A simple cousin of SGLang's radix cache. A turn of a multi-turn episode
(``GenerateRequest.multi_turn``; the episode keeps one ``request_id`` across its turns,
which is the session's key) leaves its KV here when it finishes: the tokens fed to the
model (prompt + output but the last sampled token, which was never fed) and each
layer's keys and values for them. When the session's next turn is admitted and its
context extends those tokens exactly, the engine takes the entry and feeds only the
rest; on a mismatch the entry is dropped and the turn prefills from scratch.

Entries live under the engine's KV budget, behind the running requests: the engine
evicts least recently used entries until they fit in what the running requests leave
(:meth:`PrefixCache.evict_to`). KV computed with other weights is wrong for the new
ones, so a weight update clears the cache (:meth:`PrefixCache.clear`).
"""

import collections
from collections.abc import Sequence

import torch


class CachedPrefix:
    """One session's cached KV.

    Attributes:
        token_ids: the tokens whose KV is held, in order.
        keys, values: per layer, ``[1, heads, len(token_ids), head_dim]``.
    """

    def __init__(
        self,
        token_ids: tuple[int, ...],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> None:
        assert all(k.shape[2] == len(token_ids) for k in keys)
        self.token_ids = token_ids
        self.keys = keys
        self.values = values

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is held."""
        return len(self.token_ids)

    def extended_by(self, context_ids: Sequence[int]) -> bool:
        """Whether ``context_ids`` starts with these tokens and has at least one more
        (a prefill needs one new token to give next-token logits)."""
        n = self.num_tokens
        return len(context_ids) > n and tuple(context_ids[:n]) == self.token_ids


class PrefixCache:
    """Cached prefixes by session, least recently used first, with hit counters."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[str, CachedPrefix] = collections.OrderedDict()
        self._tokens = 0
        self.hit_tokens = 0
        """Prefill tokens saved so far: the prefix tokens of every hit."""
        self.num_hits = 0
        """Turns that reused a cached prefix."""
        self.num_misses = 0
        """Multi-turn requests admitted with no usable prefix (none cached, a
        mismatch, or evicted)."""
        self.num_evicted = 0
        """Entries evicted to make room."""

    @property
    def num_tokens(self) -> int:
        """KV tokens the cached prefixes hold together."""
        return self._tokens

    def __len__(self) -> int:
        """Sessions with a cached prefix."""
        return len(self._entries)

    def __contains__(self, session: str) -> bool:
        return session in self._entries

    def put(self, session: str, prefix: CachedPrefix) -> None:
        """Keep ``prefix`` as ``session``'s (replacing any older one), most recently
        used."""
        self.drop(session)
        self._entries[session] = prefix
        self._tokens += prefix.num_tokens

    def match_tokens(self, session: str, context_ids: Sequence[int]) -> int:
        """Tokens of ``context_ids`` that ``session``'s entry would save (0 if none
        fits); changes nothing."""
        entry = self._entries.get(session)
        return entry.num_tokens if entry is not None and entry.extended_by(context_ids) else 0

    def take(self, session: str, context_ids: Sequence[int]) -> CachedPrefix | None:
        """Remove ``session``'s entry and return it if ``context_ids`` extends it; a
        mismatching entry is dropped. Counts a hit or a miss."""
        entry = self._entries.get(session)
        if entry is not None:
            self.drop(session)
            if entry.extended_by(context_ids):
                self.num_hits += 1
                self.hit_tokens += entry.num_tokens
                return entry
        self.num_misses += 1
        return None

    def drop(self, session: str) -> None:
        """Forget ``session``'s entry, if any (its episode ended or moved away)."""
        entry = self._entries.pop(session, None)
        if entry is not None:
            self._tokens -= entry.num_tokens

    def evict_to(self, budget_tokens: int) -> None:
        """Evict least recently used entries until they hold at most
        ``budget_tokens``."""
        while self._entries and self._tokens > max(budget_tokens, 0):
            _, entry = self._entries.popitem(last=False)
            self._tokens -= entry.num_tokens
            self.num_evicted += 1

    def clear(self) -> None:
        """Forget every entry (the weights changed, or the KV memory was released)."""
        self._entries.clear()
        self._tokens = 0
