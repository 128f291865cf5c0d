"""From a run's layout to the pipeline the control plane models.

A :class:`~dynarl.control.layout.PipelineLayout` is what the control plane needs to
know of a run's configuration, in plain numbers; this module, which knows nothing of
the configuration tree, turns it into the pipeline spec, the
initial placement (the actor on the first devices, then rollout, then inference, as
the reference system lays them out so the actor always holds a prefix of the devices)
and the baseline device counts static policies and recovery refer to.
"""

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.layout import PipelineLayout
from dynarl.control.plan import InstanceSpec
from dynarl.control.scheduler import Baseline
from dynarl.control.topology import (
    ACTOR,
    INFERENCE,
    ROLLOUT,
    PipelineSpec,
    rl_pipeline,
    valid_dp_sizes,
)
from dynarl.core.ids import ComponentId, DeviceId, InstanceId


def build_pipeline(
    layout: PipelineLayout,
) -> tuple[PipelineSpec, dict[ComponentId, list[InstanceSpec]], Baseline]:
    """The pipeline spec, initial placement and baseline of ``layout``."""
    actor_unit = layout.actor_devices_per_replica
    spec = rl_pipeline(
        rollout_tp=layout.rollout_tp,
        rollout_tail_tp=layout.rollout_tail_tp,
        inference_tp=layout.inference_tp,
        actor_devices_per_replica=actor_unit,
        rollout_max_running=layout.rollout_max_running,
        actor_steps_per_iteration=layout.actor_steps_per_iteration,
        actor_steps_in_arrival_order=layout.actor_steps_in_arrival_order,
        actor_dp_sizes=valid_dp_sizes(
            layout.samples_per_minibatch,
            layout.num_devices // actor_unit,
            allow_uneven=layout.allow_uneven_micro_batches,
        ),
        with_inference=layout.uses_inference,
    )
    placement: dict[ComponentId, list[InstanceSpec]] = {}
    next_device = 0
    stages = [
        (ACTOR, layout.actor_initial_devices, actor_unit),
        (ROLLOUT, layout.rollout_initial_devices, layout.rollout_tp),
    ]
    if layout.uses_inference:
        stages.append((INFERENCE, layout.inference_initial_devices, layout.inference_tp))
    for cid, devices, unit in stages:
        instances = []
        for i in range(devices // unit):
            ids = tuple(DeviceId(next_device + j) for j in range(unit))
            instances.append(InstanceSpec(id=InstanceId(f"{cid}-{i}"), devices=ids))
            next_device += unit
        placement[cid] = instances
    baseline = {cid: sum(len(i.devices) for i in insts) for cid, insts in placement.items()}
    return spec, placement, baseline


def build_hypergraph(layout: PipelineLayout, *, now_s: float = 0.0) -> tuple[Hypergraph, Baseline]:
    """A hypergraph of ``layout``'s pipeline in its initial placement, and the baseline."""
    spec, placement, baseline = build_pipeline(layout)
    graph = Hypergraph(
        spec,
        num_devices=layout.num_devices,
        placement=placement,
        u_low=layout.u_low,
        expected_tokens_per_request=layout.max_new_tokens / 2,
        max_tokens_per_request=layout.max_new_tokens,
        now_s=now_s,
    )
    return graph, baseline
