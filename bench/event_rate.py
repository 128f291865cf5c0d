"""Events applied to the hypergraph per second (aim: >= 100,000 on this machine).

Replays a realistic event mix of one iteration (enqueue, route, engine stats,
completion, downstream enqueue) into a fresh hypergraph, measured two ways side by
side: ``Hypergraph.apply`` alone, and ``Controller.handle`` (time stamp, apply,
listeners, trigger detection) with a policy that never plans. Prints a table and one
JSON line.
"""

import argparse
import json
import time

from _states import pipeline
from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import EMPTY_PLAN, InstanceSpec, Migration, Plan
from dynarl.control.scheduler import Trigger
from dynarl.core.clock import ManualClock
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, ItemId

PROMPTS, TO_INF = EdgeId("prompts"), EdgeId("to_inference")


def fresh(num_devices: int) -> Hypergraph:
    spec = pipeline(4, num_devices)
    engines = [
        InstanceSpec(id=InstanceId(f"rollout-{k}"), devices=(DeviceId(k),))
        for k in range(num_devices - 2)
    ]
    placement = {
        ComponentId("rollout"): engines,
        ComponentId("inference"): [
            InstanceSpec(id=InstanceId("inference-0"), devices=(DeviceId(num_devices - 2),))
        ],
        ComponentId("actor"): [
            InstanceSpec(id=InstanceId("actor-0"), devices=(DeviceId(num_devices - 1),))
        ],
    }
    return Hypergraph(spec, num_devices=num_devices, placement=placement)


def events(num_devices: int, num_items: int) -> list[ev.Event]:
    engines = [InstanceId(f"rollout-{k}") for k in range(num_devices - 2)]
    out: list[ev.Event] = [ev.IterationStarted(iteration=0)]
    for start in range(0, num_items, 256):
        refs = tuple(
            ev.ItemRef(ItemId(f"s{k}"), GroupId(f"g{k // 16}"))
            for k in range(start, min(num_items, start + 256))
        )
        out.append(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for k in range(num_items):
        out.append(
            ev.ItemRouted(edge=PROMPTS, item=ItemId(f"s{k}"), instance=engines[k % len(engines)])
        )
    for k in range(num_items):
        inst = engines[k % len(engines)]
        out.append(
            ev.EngineStats(
                instance=inst,
                kv_usage=0.5,
                num_running=8,
                num_queued=0,
                gen_tokens_per_s=500.0,
                time_s=float(k),
            )
        )
        out.append(
            ev.ItemsEnqueued(edge=TO_INF, items=(ev.ItemRef(ItemId(f"s{k}"), GroupId("g")),))
        )
        out.append(
            ev.ItemCompleted(edge=PROMPTS, item=ItemId(f"s{k}"), instance=inst, num_tokens=900)
        )
    return out


class Never:
    name = "never"

    def decide(self, graph: Hypergraph, trigger: Trigger) -> Plan:
        return EMPTY_PLAN


class NoExecutor:
    async def execute(self, migration: Migration) -> None:
        raise AssertionError("no plans here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--devices", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stream = events(args.devices, args.items)
    best_graph = best_ctl = 0.0
    for _ in range(args.repeats):
        g = fresh(args.devices)
        t0 = time.perf_counter()
        for e in stream:
            g.apply(e)
        best_graph = max(best_graph, len(stream) / (time.perf_counter() - t0))
        g.check()

        ctl = Controller(fresh(args.devices), Never(), NoExecutor(), clock=ManualClock())
        t0 = time.perf_counter()
        for e in stream:
            ctl.handle(e)
        best_ctl = max(best_ctl, len(stream) / (time.perf_counter() - t0))
        assert not ctl.statistics().events_rejected
    print(f"{'path':<24} {'events':>8} {'events/s':>12}")
    print(f"{'Hypergraph.apply':<24} {len(stream):>8} {best_graph:>12,.0f}")
    print(f"{'Controller.handle':<24} {len(stream):>8} {best_ctl:>12,.0f}")
    print(
        json.dumps(
            {
                "bench": "event_rate",
                "events_per_s": round(best_graph),
                "controller_events_per_s": round(best_ctl),
                "events": len(stream),
            }
        )
    )


if __name__ == "__main__":
    main()
