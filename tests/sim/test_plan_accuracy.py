"""How far the committed plans' predictions were from the iterations' actual ends."""

import math

import pytest

from dynarl.control.controller import CommittedPlan
from dynarl.sim.metrics import IterationRecord
from dynarl.sim.plan_accuracy import PlanAccuracy, plan_accuracy, plan_errors


def iteration(k: int, start_s: float, end_s: float) -> IterationRecord:
    return IterationRecord(
        iteration=k,
        start_s=start_s,
        end_s=end_s,
        generated_tokens=0,
        requests=0,
        num_sequences=0,
        tool_calls=0,
        busy_device_s={},
    )


def plan(time_s: float, predicted_s: float) -> CommittedPlan:
    return CommittedPlan(
        time_s=time_s, reason="r", predicted_s=predicted_s, predicted_without_s=predicted_s
    )


def test_each_plan_is_judged_against_the_end_of_the_iteration_it_was_committed_in() -> None:
    iterations = [iteration(0, 0.0, 100.0), iteration(1, 100.0, 150.0)]
    plans = [
        plan(0.0, 80.0),  # predicted 80 s left, 100 s were: -20%
        plan(60.0, 50.0),  # 40 s were: +25%
        plan(100.0, 60.0),  # at the next iteration's start: 50 s were, +20%
        plan(120.0, 0.0),  # a plan its policy did not score
        plan(130.0, math.inf),  # nor one predicted never to end
        plan(150.0, 10.0),  # after the last iteration measured
    ]
    assert plan_errors(plans, iterations) == pytest.approx([-0.2, 0.25, 0.2])
    acc = plan_accuracy(plans, iterations)
    assert acc.plans == 3
    assert acc.median == pytest.approx(0.2)
    assert acc.p90_abs == pytest.approx(0.25)


def test_only_the_measured_iterations_count_and_no_scored_plan_reads_as_none() -> None:
    warmup, measured = iteration(0, 0.0, 100.0), iteration(1, 100.0, 200.0)
    plans = [plan(10.0, 500.0), plan(150.0, 55.0)]
    assert plan_errors(plans, [measured]) == pytest.approx([0.1])
    assert plan_accuracy([plan(10.0, 0.0)], [warmup, measured]) == PlanAccuracy()
