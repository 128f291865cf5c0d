"""The scheduler's contract: a pure, synchronous ``(hypergraph, trigger) -> plan``.

A :class:`Policy` looks at the hypergraph (read only) when a :class:`Trigger` fires and
returns a :class:`~dynarl.control.plan.Plan` (possibly empty). No awaits, sockets or
clock reads: time arrives in the trigger. Policies compose: :class:`FirstOf` asks its
policies in order and returns the first non-empty plan.
"""

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

import msgspec

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.core.ids import ComponentId

TriggerKind = Literal[
    "tick",
    "step_boundary",
    "iteration_start",
    "iteration_end",
    "stage_drained",
    "placement_changed",
    "work_arrived",
]


class Trigger(msgspec.Struct, frozen=True, kw_only=True):
    """Why the scheduler is asked now, and when (seconds on the controller's clock).

    ``component`` names the component concerned (the one whose stage drained, the
    actor at a step boundary, the starved stage work arrived for), when there is one.
    """

    kind: TriggerKind
    time_s: float
    component: ComponentId | None = None


class Policy(Protocol):
    """A scheduling policy."""

    name: str

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The plan for this trigger; :data:`~dynarl.control.plan.EMPTY_PLAN` to do
        nothing. Must not mutate ``graph``."""
        ...


class StepHold(Protocol):
    """Decides which step-wise components (trainers) should not start their next step
    yet. Pure, like a policy; the controller asks it after every decision and marks
    the components it names (:attr:`~dynarl.control.elements.HyperNode.hold_steps`),
    which their workers honour at their next step boundary."""

    def holds(self, graph: Hypergraph) -> frozenset[ComponentId]:
        """The components to hold now (none: every trainer may start its next step)."""
        ...


class FirstOf:
    """Ask policies in order; the first non-empty plan wins."""

    def __init__(self, name: str, policies: Sequence[Policy]) -> None:
        self.name = name
        self.policies = tuple(policies)

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The first non-empty plan of the policies."""
        for policy in self.policies:
            plan = policy.decide(graph, trigger)
            if plan:
                return plan
        return EMPTY_PLAN


Baseline = Mapping[ComponentId, int]
"""Devices per component in the initial placement."""
