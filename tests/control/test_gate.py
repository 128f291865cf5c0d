"""The predictor gate: a rule's plan is committed only if it beats keeping the
placement and, given a rival, the rival's plan."""

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, Plan
from dynarl.control.planner import PlanBuilder
from dynarl.control.policies.gate import PredictorGate
from dynarl.control.scheduler import Trigger
from dynarl.control.scoring import remaining_time, score_plan
from dynarl.control.topology import ACTOR, ROLLOUT

from .test_policies import predictor_for, tail_state, tick


class Moves:
    """A policy that moves ``engines`` rollout engines to the actor."""

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.name = f"move-{engines}"

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        builder = PlanBuilder(graph)
        if self.engines == 0 or not builder.move(ROLLOUT, ACTOR, drain=self.engines):
            return EMPTY_PLAN
        return builder.build(f"move {self.engines} engines")


def test_the_gate_commits_the_better_of_the_rule_and_its_rival() -> None:
    g = tail_state(low_engines=5)
    predictor = predictor_for(g)
    before = {c: n.num_active_devices for c, n in g.components.items()}
    base = remaining_time(g, predictor, before)
    one, four = Moves(1).decide(g, tick(1.0)), Moves(4).decide(g, tick(1.0))
    # At the rollout's tail, with 2000 samples waiting for the actor, every engine
    # moved to it pays: four beat one, which beats keeping the placement.
    assert score_plan(g, predictor, four, before) < score_plan(g, predictor, one, before) < base

    alone = PredictorGate(Moves(1), predictor, min_gain=0.0).decide(g, tick(1.0))
    assert alone.migrations == one.migrations
    assert alone.score_after < alone.score_before

    behind_better = PredictorGate(Moves(1), predictor, min_gain=0.0, rival=Moves(4))
    assert behind_better.decide(g, tick(1.0)).migrations == four.migrations

    behind_worse = PredictorGate(Moves(4), predictor, min_gain=0.0, rival=Moves(1))
    assert behind_worse.decide(g, tick(1.0)).migrations == four.migrations
    behind_none = PredictorGate(Moves(1), predictor, min_gain=0.0, rival=Moves(0))
    assert behind_none.decide(g, tick(1.0)).migrations == one.migrations
