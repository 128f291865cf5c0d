"""Hypergraph states for the control-plane benchmarks: a cluster mid-iteration."""

import numpy as np

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec
from dynarl.control.predictor import Predictor
from dynarl.control.topology import (
    ComponentSpec,
    EdgeSpec,
    PipelineSpec,
    rl_pipeline,
    valid_dp_sizes,
)
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, ItemId


def pipeline(num_components: int, max_dp: int) -> PipelineSpec:
    """The math pipeline (4 components), or a 7-component agentic PPO pipeline
    (rollout, tool, reward, reference, old-policy inference, critic, actor)."""
    sizes = valid_dp_sizes(2048, max_dp)
    if num_components <= 4:
        return rl_pipeline(
            rollout_tp=1,
            inference_tp=1,
            actor_devices_per_replica=1,
            actor_dp_sizes=sizes,
            rollout_max_running=128,
            actor_steps_per_iteration=4,
        )
    c = ComponentId
    comps = (
        ComponentSpec(
            id=c("rollout"), kind="rollout", scaling="concave", max_load_per_instance=128
        ),
        ComponentSpec(id=c("tool"), kind="tool", devices_per_instance=0),
        ComponentSpec(id=c("reward"), kind="reward", devices_per_instance=0),
        ComponentSpec(id=c("reference"), kind="inference", interruptible_at="micro_batch"),
        ComponentSpec(id=c("inference"), kind="inference", interruptible_at="micro_batch"),
        ComponentSpec(
            id=c("critic"),
            kind="actor",
            interruptible_at="optimizer_step",
            valid_sizes=sizes,
            steps_per_iteration=4,
        ),
        ComponentSpec(
            id=c("actor"),
            kind="actor",
            interruptible_at="optimizer_step",
            valid_sizes=sizes,
            steps_per_iteration=4,
        ),
    )
    e = EdgeId
    edges = (
        EdgeSpec(id=e("prompts"), producer=None, consumers=(c("rollout"),)),
        EdgeSpec(id=e("to_reward"), producer=c("rollout"), consumers=(c("reward"),)),
        EdgeSpec(id=e("to_reference"), producer=c("rollout"), consumers=(c("reference"),)),
        EdgeSpec(id=e("to_inference"), producer=c("rollout"), consumers=(c("inference"),)),
        EdgeSpec(id=e("to_critic"), producer=c("inference"), consumers=(c("critic"),)),
        EdgeSpec(id=e("to_actor"), producer=c("inference"), consumers=(c("actor"),)),
    )
    return PipelineSpec(components=comps, edges=edges)


def mid_iteration(num_devices: int, num_components: int, seed: int = 0) -> Hypergraph:
    """A cluster at the rollout tail: 64 sequences per device, most finished; most
    engines below u_low for a while; samples waiting for the trainers."""
    spec = pipeline(num_components, num_devices)
    on = [s.id for s in spec.components if s.on_devices]
    share = {cid: max(1, num_devices // 8) for cid in on if cid != "rollout"}
    share[ComponentId("rollout")] = num_devices - sum(share.values())
    placement: dict[ComponentId, list[InstanceSpec]] = {}
    dev = 0
    for cid in on:
        placement[cid] = []
        for k in range(share[cid]):
            placement[cid].append(
                InstanceSpec(id=InstanceId(f"{cid}-{k}"), devices=(DeviceId(dev),))
            )
            dev += 1
    g = Hypergraph(spec, num_devices=num_devices, placement=placement, u_low=0.2)
    rng = np.random.default_rng(seed)
    g.apply(ev.IterationStarted(iteration=0, time_s=0.0))
    n_items = 64 * num_devices
    refs = tuple(ev.ItemRef(ItemId(f"s{k}"), GroupId(f"p{k // 16}")) for k in range(n_items))
    g.apply(ev.ItemsEnqueued(edge=EdgeId("prompts"), items=refs, time_s=0.0))
    engines = sorted(g.components[ComponentId("rollout")].instances)
    running = rng.choice(n_items, size=max(len(engines), n_items // 10), replace=False)
    for k, idx in enumerate(sorted(running)):
        g.apply(
            ev.ItemRouted(
                edge=EdgeId("prompts"),
                item=ItemId(f"s{idx}"),
                instance=engines[k % len(engines)],
                time_s=1.0,
            )
        )
    done = [i for i in range(n_items) if i not in set(running.tolist())]
    downstream = [e.id for e in g.edges.values() if e.spec.producer == ComponentId("rollout")]
    for k, idx in enumerate(done):
        item = ItemId(f"s{idx}")
        g.apply(
            ev.ItemRouted(
                edge=EdgeId("prompts"), item=item, instance=engines[k % len(engines)], time_s=2.0
            )
        )
        for edge in downstream:
            g.apply(
                ev.ItemsEnqueued(edge=edge, items=(ev.ItemRef(item, GroupId("p")),), time_s=2.0)
            )
        g.apply(
            ev.ItemCompleted(
                edge=EdgeId("prompts"),
                item=item,
                instance=engines[k % len(engines)],
                num_tokens=1000,
                time_s=2.0,
            )
        )
    for k, inst in enumerate(engines):
        usage = 0.05 if k % 10 else 0.6
        g.apply(
            ev.EngineStats(
                instance=inst,
                kv_usage=usage,
                num_running=6,
                num_queued=0,
                gen_tokens_per_s=600.0,
                time_s=3.0,
            )
        )
    return g


def fitted_predictor(g: Hypergraph) -> Predictor:
    """A predictor fitted to a simple world (decode 20 ms + 0.3 ms/sequence per device)."""
    p = Predictor({c: n.spec.scaling for c, n in g.components.items()})
    for cid, node in g.components.items():
        for n in (1, 4, 16, 64):
            for load in (8, 128, 1024):
                if node.spec.scaling == "concave":
                    p.observe(cid, n, load, load / (0.02 + 0.0003 * load / n))
                else:
                    p.observe(cid, n, load, 20.0 * n)
    return p
