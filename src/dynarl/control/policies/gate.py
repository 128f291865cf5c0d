"""Commit a rule's plan only if the predictor says it pays.

The iteration-phase rules of the reference system (rollout borrows the actor's
devices; the actor takes the cluster) ignore what a move costs. Behind
:class:`PredictorGate` they obey the same contract as every dynamic decision: a plan is
committed only when its predicted remaining iteration time, migration costs included,
beats keeping the placement by ``min_gain``. Given a ``rival`` (a policy later in the
chain, or the same rule made another way: the iteration start's borrow with the
rollout's engines at its tail size), the gate commits whichever of the two plans is
predicted better. A rule comes first in a chain, so without the rival its merely good
plan would stop the better one behind it: on
simulated 32B math at 64 GPUs, returning the borrowed devices to the trainer at the
rollout's end (predicted 823 s -> 778 s) kept the bottleneck policy from sending them
all to inference (predicted -> 665 s), and the trainer ran its first step on 16
devices for 69 s while inference was the bottleneck.
"""

import msgspec

from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Policy, Trigger
from dynarl.control.scoring import remaining_time, score_plan


class PredictorGate:
    """Wraps a policy; passes its plans on only when they strictly improve."""

    def __init__(
        self,
        policy: Policy,
        predictor: Predictor,
        min_gain: float,
        rival: Policy | None = None,
        estimates: Estimates | None = None,
    ) -> None:
        self.estimates = or_fresh(estimates)
        self.policy = policy
        self.predictor = predictor
        self.min_gain = min_gain
        self.rival = rival
        self.name = f"gated-{policy.name}"

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        """The wrapped policy's plan, if it beats doing nothing -- or the rival's, if
        that is predicted better still."""
        plan = self.policy.decide(graph, trigger)
        if not plan:
            return plan
        before = {c: n.num_active_devices for c, n in graph.components.items()}
        est = self.estimates
        base = remaining_time(graph, self.predictor, before, estimates=est)
        after = score_plan(graph, self.predictor, plan, before, estimates=est)
        if not after < base * (1.0 - self.min_gain):
            return EMPTY_PLAN
        if self.rival is not None:
            other = self.rival.decide(graph, trigger)
            if other:
                rival = score_plan(graph, self.predictor, other, before, estimates=est)
                if rival < after:
                    # Committed here: returning nothing would let the policies between
                    # this rule and its rival decide instead.
                    plan, after = other, rival
        if plan.score_after:
            return plan  # a policy's plan, with its own figures
        return msgspec.structs.replace(
            plan,
            reason=f"{plan.reason}: predicted {base:.1f}s -> {after:.1f}s",
            score_before=base,
            score_after=after,
        )
