"""Scheduling decision latency at 8-1024 devices (the reference system needs <200 ms).

Measures ``policy.decide`` of the dynamic mode on a cluster at the rollout tail (the
state where it has the most donors and candidates to weigh), with 3 and 7 components.
Prints a table and one JSON line; aims: p99 < 5 ms at 128 devices, < 50 ms at 1024.
"""

import argparse
import json
import time

import numpy as np

from _states import fitted_predictor, mid_iteration
from dynarl.control.config import SchedulerConfig
from dynarl.control.modes import make_policy
from dynarl.control.scheduler import Trigger


def measure(num_devices: int, num_components: int, repeats: int) -> tuple[float, float, int]:
    g = mid_iteration(num_devices, num_components)
    policy = make_policy(
        SchedulerConfig(donor_window_s=0.5),
        fitted_predictor(g),
        {c: n.num_active_devices for c, n in g.components.items()},
    )
    times = []
    committed = 0
    for k in range(repeats):
        trigger = Trigger(kind="tick", time_s=10.0 + k * 1e-3)
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
    print(f"{'devices':>8} {'components':>10} {'p50 ms':>8} {'p99 ms':>8} {'plans':>6}")
    for devices in (8, 64, 128, 1024):
        worst = 0.0
        for comps in (4, 7):
            repeats = max(20, args.repeats // (4 if devices >= 1024 else 1))
            p50, q99, committed = measure(devices, comps, repeats)
            worst = max(worst, q99)
            print(f"{devices:>8} {comps:>10} {p50:>8.3f} {q99:>8.3f} {committed:>6}")
        p99[str(devices)] = round(worst, 3)
    print(json.dumps({"bench": "plan_latency", "p99_ms": p99}))


if __name__ == "__main__":
    main()
