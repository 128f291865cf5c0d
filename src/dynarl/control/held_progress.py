"""The tokens each request an instance holds has generated, kept as arrays in step
with its holder, so the scheduler reads every pending request's progress with a few
array operations per engine instead of one Python step per request (it does so at
every decision: the rollout's end depends on its least advanced long request).

A running request's progress is its ``generated`` plus what its engine's per-request
counter gained since it started (``tokens_per_request - mark``, see
:class:`~dynarl.control.elements.Node`); a waiting one's is its ``generated``. The
arrays hold each request's ``generated``, ``mark`` and whether it runs, and are
written whenever one of those changes, which happens only when the request is routed,
starts, is preempted or leaves -- never on an engine's stats report.
"""

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from dynarl.control.elements import ItemState

FloatArray = npt.NDArray[np.float64]


class HeldProgress:
    """The requests one instance holds, in no particular order (each knows its row,
    ``ItemState.slot``); a removed row is filled by the last."""

    __slots__ = ("_generated", "_items", "_mark", "_running")

    def __init__(self) -> None:
        self._items: list[ItemState] = []
        self._generated: FloatArray = np.zeros(8)
        self._mark: FloatArray = np.zeros(8)
        self._running = np.zeros(8, dtype=bool)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, st: "ItemState") -> None:
        """Hold ``st`` from now on."""
        row = len(self._items)
        if row == len(self._generated):
            self._generated = np.resize(self._generated, 2 * row)
            self._mark = np.resize(self._mark, 2 * row)
            self._running = np.resize(self._running, 2 * row)
        self._items.append(st)
        st.slot = row
        self.update(st)

    def update(self, st: "ItemState") -> None:
        """``st``'s ``generated``, ``mark`` or ``running`` changed."""
        row = st.slot
        self._generated[row] = st.generated
        self._mark[row] = st.mark
        self._running[row] = st.running

    def remove(self, st: "ItemState") -> None:
        """``st`` left."""
        row = st.slot
        last = self._items.pop()
        if last is not st:
            self._items[row] = last
            last.slot = row
            self.update(last)

    def progress(self, tokens_per_request: float) -> FloatArray:
        """Each held request's tokens generated, given the engine's per-request counter
        (``Node.progress_of`` of each, to the last bit)."""
        n = len(self._items)
        generated = self._generated[:n]
        # (generated + counter) - mark, summed as progress_of sums it
        running = (generated + tokens_per_request) - self._mark[:n]
        return np.where(self._running[:n], running, generated)
