"""The scheduler's section of the configuration."""

from typing import Annotated, Literal

import msgspec

from dynarl.core.config import Section

SchedulingMode = Literal["dynamic", "static-colocated", "static-disaggregated", "rlhfuse"]
"""Policies of one system: move devices to the bottleneck (``dynamic``), give all
devices to each stage in turn (``static-colocated``, like verl), keep a fixed split
and pipeline (``static-disaggregated``, like RLinf), or the colocated schedule with
RLHFuse-style fusion of the rollout tail with inference (``rlhfuse``)."""


class SchedulerConfig(Section, frozen=True, kw_only=True):
    """How and when devices move between components.

    Attributes:
        mode: the scheduling policy.
        u_low: KV usage below which a rollout engine counts as under-used (0.1-0.3 stays
            within 1.5% of peak in the reference measurements; 0.01 thrashes).
        theta: fraction of a rollout component's engines that must be under-used for it
            to donate devices.
        donor_window_s: seconds (T) the engines must stay under-used (2-8 s is best).
        tick_s: period of the scheduler's periodic trigger.
        num_candidates: candidate plans scored per receiving component and decision
            (3-10).
        min_gain: relative improvement of the predicted remaining iteration time a plan
            must bring, beyond its own migration cost, to be committed.
        rollout_borrows_actor: (dynamic mode) at iteration start, lend the actor's
            devices to rollout and hand them back once rollout's running work falls below
            ``borrow_return_fraction`` of the batch and its engines are under-used (the
            donor signal: ``u_low``, ``theta``, ``donor_window_s``).
        borrow_return_fraction: see ``rollout_borrows_actor``.
        actor_takes_cluster: (dynamic mode) before the actor's last minibatch, give it every device
            the other components no longer need.
        hold_trainer: (dynamic mode) keep the trainer from starting an optimizer step
            on its own few devices when the predictor says the step ends sooner if it
            waits for the devices the other stages free as they finish (a step runs to
            its end on the devices it started on, and the freed devices would wait for
            it).
        fusion_tail_fraction: (rlhfuse mode) once rollout's running requests fit on
            this fraction of its engines without slowing any decode step (no engine
            holding more requests than its cap or more KV than the busiest one), they
            are consolidated there and the freed devices start inference.
        predictor_profile: a real run's predictor starts from this profile (a JSON
            file: :class:`~dynarl.control.predictor_profile.Profile`), such as the
            ``predictor.json`` an earlier run on the same cluster wrote into its run
            directory with each checkpoint, instead of from nothing; a resumed run
            starts from its own ``predictor.json`` when this is not set. (The
            simulator seeds its predictor with a profiling run on the simulated
            hardware and refuses this setting.)
    """

    mode: SchedulingMode = "dynamic"
    u_low: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2
    theta: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
    donor_window_s: Annotated[float, msgspec.Meta(ge=0.0)] = 4.0
    tick_s: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    num_candidates: Annotated[int, msgspec.Meta(ge=3, le=10)] = 5
    min_gain: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.02
    rollout_borrows_actor: bool = True
    borrow_return_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2
    actor_takes_cluster: bool = True
    hold_trainer: bool = True
    fusion_tail_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2
    predictor_profile: str | None = None
