"""The scheduler's memory between calls: estimates read from the hypergraph, kept for
as long as the hypergraph is unchanged.

The rollout's remaining lengths (:mod:`dynarl.control.rollout_lengths`), the trainer's
step plan (:mod:`dynarl.control.trainer_steps`) and the re-prefill a drained engine
causes (:func:`~dynarl.control.scoring.score_plan`) each read every pending request.
One decision asks for them many times -- every candidate plan is scored against them,
and the trainer's hold is decided after the plan -- so :class:`Estimates` computes each
once per state of the hypergraph (its count of applied events) and hands it out until
the next event.

An :class:`Estimates` belongs to one controller: its policies and its hold share it
(:func:`~dynarl.control.modes.make_policy`, :func:`~dynarl.control.modes.make_hold`).
Its contents never change an answer: every entry is what its function returns for the
hypergraph as it is, so a decision is a function of the hypergraph, the trigger and
the predictor alone, and a policy given a fresh :class:`Estimates` decides exactly as
one given a warm one.
"""

from collections.abc import Callable, Hashable
from typing import TypeVar, cast

from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import InstanceId

T = TypeVar("T")

EngineState = tuple[float, int, float, float]
"""What an engine's re-prefill sum depends on: its last report's time, its item count,
its progress base and its tokens per running request."""


class Estimates:
    """Values computed from one state of a hypergraph, reused until it changes."""

    __slots__ = ("_events", "_graph", "_reprefill", "_reprefill_cost", "_values")

    def __init__(self) -> None:
        self._graph: Hypergraph | None = None
        self._events = -1
        self._values: dict[Hashable, object] = {}
        # Per engine: (its state, seconds to re-prefill its requests), for one
        # prefill cost. Kept across events: an engine's sum changes only when it
        # reports or its requests change, and each decision drains the same engines.
        self._reprefill: dict[InstanceId, tuple[EngineState, float]] = {}
        self._reprefill_cost: object = None

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

    def reprefill_s(
        self,
        graph: Hypergraph,
        engine: InstanceId,
        state: EngineState,
        cost: object,
        compute: Callable[[], float],
    ) -> float:
        """``compute()``, the seconds to re-prefill ``engine``'s requests at the
        prefill ``cost``, reused while the engine's ``state`` and the cost stay."""
        self._sync(graph)
        if cost is not self._reprefill_cost:
            self._reprefill.clear()
            self._reprefill_cost = cost
        known = self._reprefill.get(engine)
        if known is None or known[0] != state:
            known = (state, compute())
            self._reprefill[engine] = known
        return known[1]

    def _sync(self, graph: Hypergraph) -> None:
        if graph is not self._graph:
            self._graph = graph
            self._reprefill.clear()
            self._events = -1
        if graph.events_applied != self._events:
            self._events = graph.events_applied
            self._values.clear()


def or_fresh(estimates: Estimates | None) -> Estimates:
    """``estimates``, or a fresh (empty) one: the answer is the same either way."""
    return estimates if estimates is not None else Estimates()
