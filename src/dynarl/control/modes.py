"""Scheduling modes: which policy each mode runs, as a table."""

from collections.abc import Callable
from functools import partial

from dynarl.control.config import SchedulerConfig, SchedulingMode
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.policies.bottleneck import BottleneckPolicy
from dynarl.control.policies.colocated import ColocatedPolicy
from dynarl.control.policies.gate import PredictorGate
from dynarl.control.policies.hold import HoldForDevices
from dynarl.control.policies.phases import ActorTakesCluster, RolloutBorrowsActor
from dynarl.control.policies.rebalance import RebalanceTail
from dynarl.control.policies.recovery import RebootCrashed
from dynarl.control.policies.resize import ResizeEngines, tail_unit
from dynarl.control.policies.rlhfuse import RlhfusePolicy
from dynarl.control.policies.starved import StarvedStage
from dynarl.control.predictor import Predictor
from dynarl.control.scheduler import Baseline, FirstOf, Policy, StepHold

PolicyFactory = Callable[[SchedulerConfig, Predictor, Baseline, Estimates], Policy]


def _dynamic(
    cfg: SchedulerConfig, predictor: Predictor, baseline: Baseline, est: Estimates
) -> Policy:
    policies: list[Policy] = [RebootCrashed(baseline)]
    if cfg.actor_takes_cluster:
        policies.append(
            PredictorGate(ActorTakesCluster(est), predictor, cfg.min_gain, estimates=est)
        )
    bottleneck = BottleneckPolicy(cfg, predictor, est)
    if cfg.rollout_borrows_actor:
        # Lending at iteration start is the rule's call; giving the devices back at the
        # tail competes with the bottleneck policy's plan (see PredictorGate).
        lend = RolloutBorrowsActor(baseline, cfg, phase="start")
        # The same, its engines at the rollout's tail size: the better of the two.
        wide = RolloutBorrowsActor(
            baseline, cfg, phase="start", engine_size=partial(tail_unit, predictor=predictor)
        )
        give_back = RolloutBorrowsActor(baseline, cfg, phase="return")
        policies.append(PredictorGate(lend, predictor, cfg.min_gain, rival=wide, estimates=est))
        policies.append(
            PredictorGate(give_back, predictor, cfg.min_gain, rival=bottleneck, estimates=est)
        )
    policies.append(StarvedStage(est, fuller=bottleneck))
    policies.append(ResizeEngines(cfg, predictor, est))
    policies.append(RebalanceTail(cfg, predictor, est))
    policies.append(bottleneck)
    return FirstOf("dynamic", policies)


def _colocated(
    cfg: SchedulerConfig, predictor: Predictor, baseline: Baseline, est: Estimates
) -> Policy:
    return FirstOf("static-colocated", [ColocatedPolicy(est)])


def _disaggregated(
    cfg: SchedulerConfig, predictor: Predictor, baseline: Baseline, est: Estimates
) -> Policy:
    return FirstOf("static-disaggregated", [RebootCrashed(baseline)])


def _rlhfuse(
    cfg: SchedulerConfig, predictor: Predictor, baseline: Baseline, est: Estimates
) -> Policy:
    return FirstOf("rlhfuse", [RlhfusePolicy(cfg.fusion_tail_fraction)])


POLICIES: dict[SchedulingMode, PolicyFactory] = {
    "dynamic": _dynamic,
    "static-colocated": _colocated,
    "static-disaggregated": _disaggregated,
    "rlhfuse": _rlhfuse,
}


def make_policy(
    cfg: SchedulerConfig,
    predictor: Predictor,
    baseline: Baseline,
    estimates: Estimates | None = None,
) -> Policy:
    """The policy of ``cfg.mode``: ``dynamic`` reboots crashed devices, lets the actor
    take the cluster before its last minibatch, lends the actor's devices to rollout at
    iteration start (these two only when the predictor says they pay; the lending at the
    rollout's own engine size or at its tail size, whichever is predicted better), starts stages
    that have work and no device (with the bottleneck policy's plan when that starts
    them too), regroups the rollout's engines into wider ones for its tail (where
    ``rollout.tail_tp`` allows it), spreads the rollout tail's hot engines over the idle
    ones, and otherwise moves devices to the predicted bottleneck (these three when the
    predictor says they pay);
    ``static-colocated`` hands every device to each stage in turn;
    ``static-disaggregated`` keeps the initial split (rebooting crashed devices);
    ``rlhfuse`` is colocated, but consolidates the rollout tail onto few engines and
    starts inference on the freed devices.

    ``estimates`` is what the policies read from the hypergraph, kept while it is
    unchanged (:mod:`~dynarl.control.estimates`): pass the controller's one to the
    policy and to :func:`make_hold` (a fresh one if none; decisions are the same)."""
    return POLICIES[cfg.mode](cfg, predictor, baseline, or_fresh(estimates))


def make_hold(
    cfg: SchedulerConfig, predictor: Predictor, estimates: Estimates | None = None
) -> StepHold | None:
    """What decides when trainers wait at a step boundary for devices on their way:
    :class:`~dynarl.control.policies.hold.HoldForDevices` in ``dynamic`` mode with
    ``hold_trainer``; nothing otherwise (a trainer starts each step once its minibatch
    is ready)."""
    if cfg.mode != "dynamic" or not cfg.hold_trainer:
        return None
    return HoldForDevices(predictor, estimates)
