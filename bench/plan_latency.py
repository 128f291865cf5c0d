"""Scheduling decision latency at 8-1024 devices (the reference system needs <200 ms).

Measures ``policy.decide`` of the dynamic mode on a cluster at the rollout tail (the
state where it has the most donors and candidates to weigh), with 4 and 7 components:
decisions on one state of the hypergraph (``p99 ms``), and decisions each after an
engine's report (``after event``: as in a run, what the policy read from the hypergraph
before is read afresh). Prints a table and one JSON line; aims: p99 < 5 ms at 128
devices, < 50 ms at 1024.
"""

import argparse
import json
import time

import numpy as np

from _states import fitted_predictor, mid_iteration
from dynarl.control import events as ev
from dynarl.control.config import SchedulerConfig
from dynarl.control.modes import make_policy
from dynarl.control.scheduler import Trigger
from dynarl.control.topology import ROLLOUT


def measure(
    num_devices: int, num_components: int, repeats: int, *, after_event: bool = False
) -> tuple[float, float, int]:
    g = mid_iteration(num_devices, num_components)
    engine = sorted(g.components[ROLLOUT].instances)[0]
    policy = make_policy(
        SchedulerConfig(donor_window_s=0.5),
        fitted_predictor(g),
        {c: n.num_active_devices for c, n in g.components.items()},
    )
    times = []
    committed = 0
    for k in range(repeats):
        trigger = Trigger(kind="tick", time_s=10.0 + k * 1e-3)
        if after_event:
            node = g.instances[engine]
            g.apply(
                ev.EngineStats(
                    instance=engine,
                    kv_usage=node.kv_usage,
                    num_running=node.num_running,
                    num_queued=0,
                    gen_tokens_per_s=node.gen_tokens_per_s,
                    time_s=trigger.time_s,
                )
            )
        t0 = time.perf_counter()
        plan = policy.decide(g, trigger)
        times.append(time.perf_counter() - t0)
        committed += bool(plan)
    ms = np.array(times) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), committed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    p99: dict[str, float] = {}
    p99_event: dict[str, float] = {}
    print(
        f"{'devices':>8} {'components':>10} {'p50 ms':>8} {'p99 ms':>8} {'plans':>6}"
        f" {'after event: p50':>17} {'p99':>8}"
    )
    for devices in (8, 64, 128, 1024):
        worst = worst_event = 0.0
        for comps in (4, 7):
            repeats = max(20, args.repeats // (4 if devices >= 1024 else 1))
            p50, q99, committed = measure(devices, comps, repeats)
            e50, e99, _ = measure(devices, comps, repeats, after_event=True)
            worst, worst_event = max(worst, q99), max(worst_event, e99)
            print(
                f"{devices:>8} {comps:>10} {p50:>8.3f} {q99:>8.3f} {committed:>6}"
                f" {e50:>17.3f} {e99:>8.3f}"
            )
        p99[str(devices)] = round(worst, 3)
        p99_event[str(devices)] = round(worst_event, 3)
    print(json.dumps({"bench": "plan_latency", "p99_ms": p99, "p99_ms_after_event": p99_event}))


if __name__ == "__main__":
    main()
