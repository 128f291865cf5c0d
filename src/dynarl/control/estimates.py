"""The scheduler's memory between calls: estimates read from the hypergraph, kept for
as long as the hypergraph is unchanged.

The rollout's remaining lengths (:mod:`dynarl.control.rollout_lengths`), the trainer's
step plan (:mod:`dynarl.control.trainer_steps`) and the re-prefill a drained engine
causes (:func:`~dynarl.control.scoring.score_plan`) each read every pending request.
One decision asks for them many times -- every candidate plan is scored against them,
and the trainer's hold is decided after the plan -- so :class:`Estimates` computes each
once per state of the hypergraph (its count of applied events) and hands it out until
the next event. What is read from one engine's requests (the re-prefill its draining
causes, as a function of its progress) is kept per engine until that engine's requests
change (:meth:`Estimates.per_engine`): an engine reports progress at every stats
event, but holds and runs the same requests for many.

An :class:`Estimates` belongs to one controller: its policies and its hold share it
(:func:`~dynarl.control.modes.make_policy`, :func:`~dynarl.control.modes.make_hold`).
Its contents never change an answer: every entry is what its function returns for the
hypergraph as it is, so a decision is a function of the hypergraph, the trigger and
the predictor alone, and a policy given a fresh :class:`Estimates` decides exactly as
one given a warm one.
"""

from collections.abc import Callable, Hashable
from typing import TypeVar, cast

from dynarl.control.elements import Node
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import InstanceId

T = TypeVar("T")


class Estimates:
    """Values computed from one state of a hypergraph, reused until it changes."""

    __slots__ = ("_engines", "_events", "_graph", "_values")

    def __init__(self) -> None:
        self._graph: Hypergraph | None = None
        self._events = -1
        self._values: dict[Hashable, object] = {}
        # Per engine: (the engine, its version, the value's key, the value). Kept
        # across events: what is read from an engine's requests changes only when
        # which requests it holds or runs does, and each decision drains the same
        # engines.
        self._engines: dict[InstanceId, tuple[Node, int, Hashable, object]] = {}

    def get(self, graph: Hypergraph, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` for ``graph`` as it is, computed once per state of it
        (``key`` names the value: the function and its arguments)."""
        self._sync(graph)
        try:
            return cast(T, self._values[key])
        except KeyError:
            value = compute()
            self._values[key] = value
            return value

    def per_engine(
        self, graph: Hypergraph, node: Node, key: Hashable, compute: Callable[[], T]
    ) -> T:
        """``compute()``, a value read from the requests ``node`` (an engine of
        ``graph``) holds, reused while it holds and runs the same ones
        (:attr:`Node.version <dynarl.control.elements.Node.version>`) and ``key``
        (what else the value depends on) stays. One value per engine is kept, and
        only for engines the hypergraph still has (the others are dropped whenever
        the kept ones outnumber its instances twice: engines restart under new ids)."""
        self._sync(graph)
        engines = self._engines
        known = engines.get(node.id)
        if known is None or known[0] is not node or known[1] != node.version or known[2] != key:
            known = (node, node.version, key, compute())
            if node.id not in engines and len(engines) >= 2 * len(graph.instances):
                live = graph.instances
                self._engines = engines = {i: e for i, e in engines.items() if live.get(i) is e[0]}
            engines[node.id] = known
        return cast(T, known[3])

    def _sync(self, graph: Hypergraph) -> None:
        if graph is not self._graph:
            self._graph = graph
            self._engines.clear()
            self._events = -1
        if graph.events_applied != self._events:
            self._events = graph.events_applied
            self._values.clear()


def or_fresh(estimates: Estimates | None) -> Estimates:
    """``estimates``, or a fresh (empty) one: the answer is the same either way."""
    return estimates if estimates is not None else Estimates()
