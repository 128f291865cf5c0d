"""From a configuration to the pipeline the control plane models.

:func:`build_pipeline` turns a :class:`~dynarl.api.config.DynaRLConfig` into the
pipeline spec (components, dataflows, valid actor sizes), the initial placement (the
actor on the first devices, then rollout, then inference, as the reference system lays
them out so the actor always holds a prefix of the devices), and the baseline device
counts static policies and recovery refer to.
"""

from dynarl.api.config import DynaRLConfig
from dynarl.control.hypergraph import Hypergraph
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
    cfg: DynaRLConfig,
) -> tuple[PipelineSpec, dict[ComponentId, list[InstanceSpec]], Baseline]:
    """The pipeline spec, initial placement and baseline of ``cfg``."""
    actor_unit = cfg.actor.devices_per_replica
    max_dp = cfg.cluster.num_devices // actor_unit
    spec = rl_pipeline(
        rollout_tp=cfg.rollout.tp,
        inference_tp=cfg.inference.tp,
        actor_devices_per_replica=actor_unit,
        rollout_max_running=cfg.rollout.max_running_requests,
        actor_steps_per_iteration=cfg.algorithm.n_minibatches,
        actor_steps_in_arrival_order=cfg.algorithm.minibatch_order == "completion",
        actor_dp_sizes=valid_dp_sizes(
            cfg.algorithm.samples_per_minibatch,
            max_dp,
            allow_uneven=cfg.actor.allow_uneven_micro_batches,
        ),
    )
    placement: dict[ComponentId, list[InstanceSpec]] = {}
    next_device = 0
    for cid, devices, unit in (
        (ACTOR, cfg.actor.initial_devices, actor_unit),
        (ROLLOUT, cfg.rollout.initial_devices, cfg.rollout.tp),
        (INFERENCE, cfg.inference.initial_devices, cfg.inference.tp),
    ):
        instances = []
        for i in range(devices // unit):
            ids = tuple(DeviceId(next_device + j) for j in range(unit))
            instances.append(InstanceSpec(id=InstanceId(f"{cid}-{i}"), devices=ids))
            next_device += unit
        placement[cid] = instances
    baseline = {cid: sum(len(i.devices) for i in insts) for cid, insts in placement.items()}
    return spec, placement, baseline


def build_hypergraph(cfg: DynaRLConfig, *, now_s: float = 0.0) -> tuple[Hypergraph, Baseline]:
    """A hypergraph of ``cfg``'s pipeline in its initial placement, and the baseline."""
    spec, placement, baseline = build_pipeline(cfg)
    graph = Hypergraph(
        spec,
        num_devices=cfg.cluster.num_devices,
        placement=placement,
        u_low=cfg.scheduler.u_low,
        expected_tokens_per_request=cfg.rollout.max_new_tokens / 2,
        max_tokens_per_request=cfg.rollout.max_new_tokens,
        now_s=now_s,
    )
    return graph, baseline
