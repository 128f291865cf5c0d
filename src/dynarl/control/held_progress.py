"""The tokens each request an instance holds has generated, and the context it holds,
kept as arrays in step with its holder: the scheduler reads every pending request's
progress, and every drained engine's contexts, at every decision, and does so with a
few array operations per engine instead of a Python step per request.

A running request's progress is its ``generated`` plus what its engine's per-request
counter gained since it started (``tokens_per_request - mark``, see
:class:`~dynarl.control.elements.Node`); a waiting one's is its ``generated``. Its
context is its size (prompt) plus its progress, or its session's cached prefix if that
is longer. The arrays hold each request's ``generated``, ``mark``, whether it runs,
its size and its prefix, and are written whenever one of those changes, which happens
only when the request is routed, starts, is preempted or leaves -- never on an
engine's stats report.
"""

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from dynarl.control.elements import ItemState

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_FIELDS = 5  # generated, mark, running, size, prefix


class HeldProgress:
    """The requests one instance holds, in the order it took them (the order of
    ``Node.items``): each knows its row (``ItemState.slot``); a row that leaves is
    marked dead, and the dead rows are dropped once they outnumber the live ones."""

    __slots__ = ("_dead", "_items", "_live", "_values")

    def __init__(self) -> None:
        self._items: list[ItemState | None] = []
        self._values: FloatArray = np.zeros((_FIELDS, 8))
        self._live: BoolArray = np.zeros(8, dtype=bool)
        self._dead = 0

    def __len__(self) -> int:
        return len(self._items) - self._dead

    def add(self, st: "ItemState") -> None:
        """Hold ``st`` from now on (after those held already)."""
        row = len(self._items)
        if row == self._live.shape[0]:
            self._values = np.concatenate([self._values, np.zeros_like(self._values)], axis=1)
            self._live = np.concatenate([self._live, np.zeros_like(self._live)])
        self._items.append(st)
        self._live[row] = True
        st.slot = row
        self._values[3, row] = st.tokens
        self._values[4, row] = st.prefix_tokens
        self.update(st)

    def update(self, st: "ItemState") -> None:
        """``st``'s ``generated``, ``mark`` or ``running`` changed."""
        row = st.slot
        values = self._values
        values[0, row] = st.generated
        values[1, row] = st.mark
        values[2, row] = st.running

    def remove(self, st: "ItemState") -> None:
        """``st`` left."""
        self._items[st.slot] = None
        self._live[st.slot] = False
        self._dead += 1
        if self._dead > 8 and 2 * self._dead > len(self._items):
            self._compact()

    def progress(self, tokens_per_request: float) -> FloatArray:
        """Each held request's tokens generated, given the engine's per-request counter
        (``Node.progress_of`` of each, to the last bit), in the order they were taken."""
        n = len(self._items)
        generated, mark, running = self._values[0, :n], self._values[1, :n], self._values[2, :n]
        # (generated + counter) - mark, summed as progress_of sums it
        out = np.where(running != 0.0, (generated + tokens_per_request) - mark, generated)
        return out[self._live[:n]] if self._dead else out

    def contexts(self, tokens_per_request: float) -> FloatArray:
        """Each held request's tokens of context (``Node.context_of`` of each), in the
        order they were taken."""
        n = len(self._items)
        live = self._live[:n] if self._dead else slice(None)
        size, prefix = self._values[3, :n][live], self._values[4, :n][live]
        return np.maximum(size + self.progress(tokens_per_request), prefix)

    def _compact(self) -> None:
        rows = np.flatnonzero(self._live[: len(self._items)])
        self._values[:, : len(rows)] = self._values[:, rows]
        self._live[:] = False
        self._live[: len(rows)] = True
        live = [st for st in self._items if st is not None]
        for row, st in enumerate(live):
            st.slot = row
        self._items = list(live)
        self._dead = 0
