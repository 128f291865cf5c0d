"""Small hypergraphs for control-plane tests."""

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec, Plan
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT, rl_pipeline
from dynarl.core.ids import ComponentId, DeviceId, InstanceId


def make_graph(
    *,
    rollout: int = 4,
    inference: int = 2,
    actor: int = 2,
    free: int = 0,
    rollout_tp: int = 1,
    rollout_tail_tp: int = 0,
    inference_tp: int = 1,
    actor_unit: int = 1,
    actor_sizes: tuple[int, ...] = (1, 2, 4, 8),
    u_low: float = 0.2,
    actor_steps: int = 1,
    actor_steps_in_arrival_order: bool = False,
) -> Hypergraph:
    """A math pipeline with the given device counts (actor first, as the launcher lays
    it out) and ``free`` unplaced devices; each count is split into instances of
    ``actor_unit`` / ``rollout_tp`` / ``inference_tp`` devices."""
    spec = rl_pipeline(
        rollout_tp=rollout_tp,
        rollout_tail_tp=rollout_tail_tp,
        inference_tp=inference_tp,
        actor_devices_per_replica=actor_unit,
        actor_dp_sizes=actor_sizes,
        actor_steps_per_iteration=actor_steps,
        actor_steps_in_arrival_order=actor_steps_in_arrival_order,
    )
    placement: dict[ComponentId, list[InstanceSpec]] = {}
    device = 0
    for cid, count, unit in (
        (ACTOR, actor, actor_unit),
        (ROLLOUT, rollout, rollout_tp),
        (INFERENCE, inference, inference_tp),
    ):
        instances = []
        for i in range(count // unit):
            devs = tuple(DeviceId(device + j) for j in range(unit))
            instances.append(InstanceSpec(id=InstanceId(f"{cid}-{i}"), devices=devs))
            device += unit
        placement[cid] = instances
    return Hypergraph(spec, num_devices=device + free, placement=placement, u_low=u_low)


def carry_out(g: Hypergraph, plan: Plan) -> None:
    """Apply ``plan`` to ``g`` as an executor would (every migration starts, then every
    one is done), checking the invariants after each half."""
    for m in plan.migrations:
        g.apply(ev.MigrationStarted(migration=m))
    g.check()
    for m in plan.migrations:
        g.apply(ev.MigrationDone(migration=m.id))
    g.check()
