"""How well the scheduler foresaw the iterations it planned.

Every plan a scoring policy commits carries its prediction: the seconds until the
iteration's work is done if the plan is carried out
(:attr:`~dynarl.control.controller.CommittedPlan.predicted_s`). The simulated run knows
when the iteration did end, so each committed plan gives one relative error of the
scheduler's model, ``predicted / actual - 1`` with ``actual`` the seconds from the
commit to the iteration's end (negative: the model expected the iteration to end
sooner). Later plans change what happens after a commit, so an error is not the
model's alone; but a scheduler that keeps committing on a predicted 2% gain while its
predictions are off by 20% is deciding on noise, which is what this measures.
"""

import math
import statistics
from collections.abc import Sequence

import msgspec

from dynarl.control.controller import CommittedPlan
from dynarl.sim.metrics import IterationRecord


class PlanAccuracy(msgspec.Struct, frozen=True, kw_only=True):
    """The relative errors of the committed plans' predictions, over some iterations:
    their median (``median``), the 90th percentile of their magnitude (``p90_abs``)
    and how many plans were scored (``plans``; 0: no scoring policy committed any,
    and both figures are 0)."""

    median: float = 0.0
    p90_abs: float = 0.0
    plans: int = 0


def plan_errors(
    plans: Sequence[CommittedPlan], iterations: Sequence[IterationRecord]
) -> list[float]:
    """``predicted / actual - 1`` for each plan committed during one of
    ``iterations`` (from its start, inclusive, to its end) whose policy predicted a
    finite remaining time; ``actual`` runs from the commit to that iteration's end."""
    out: list[float] = []
    for plan in plans:
        if not (0.0 < plan.predicted_s < math.inf):
            continue
        for it in iterations:
            if it.start_s <= plan.time_s < it.end_s:
                out.append(plan.predicted_s / (it.end_s - plan.time_s) - 1.0)
                break
    return out


def plan_accuracy(
    plans: Sequence[CommittedPlan], iterations: Sequence[IterationRecord]
) -> PlanAccuracy:
    """The :class:`PlanAccuracy` of the plans committed during ``iterations``."""
    errors = plan_errors(plans, iterations)
    if not errors:
        return PlanAccuracy()
    magnitudes = sorted(abs(e) for e in errors)
    p90 = magnitudes[min(len(magnitudes) - 1, math.ceil(0.9 * len(magnitudes)) - 1)]
    return PlanAccuracy(median=statistics.median(errors), p90_abs=p90, plans=len(errors))
