"""A fault soak on the simulator: a job run for many iterations while moves fail
(refused, or midway after draining) and rollout engines and inference replicas are
killed at random; the real controller recovers, the hypergraph's invariants are
checked after every event, and every item is counted.

Prints a table per fault kind (injected, recovered, items requeued, recovery time in
virtual seconds, measured from the events), the mean iteration time beside a
fault-free run of the same job, and one JSON line.
"""

import argparse
import asyncio
import json

import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import simulated_run
from dynarl.sim.faults import FaultPlan
from dynarl.sim.soak import SOAK_JOB, soak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--mode", default="dynamic")
    parser.add_argument("--move-failure-rate", type=float, default=0.3)
    parser.add_argument("--mean-kill-interval-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run = simulated_run(
        DynaRLConfig(),
        [*SOAK_JOB, f"run.num_iterations={args.iterations}", f"scheduler.mode={args.mode}"],
    )
    plan = FaultPlan(
        move_failure_rate=args.move_failure_rate,
        mean_kill_interval_s=args.mean_kill_interval_s,
        seed=args.seed,
    )
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        summary, _ = runner.run(soak(run, plan))
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        clean, _ = runner.run(soak(run, FaultPlan()))
    r = summary.result
    print(
        f"{args.mode}: {summary.iterations}/{args.iterations} iterations, samples "
        f"{summary.samples}/{summary.samples_expected}, lost {summary.lost}, duplicated "
        f"{summary.duplicated}, tokens generated/requested {r.generated_tokens}/"
        f"{r.requested_tokens}, events rejected {r.events_rejected or 0}, "
        f"wall {r.wall_s:.1f} s"
    )
    print(
        f"{'fault kind':<20} {'injected':>8} {'recovered':>9} {'requeued':>8} "
        f"{'median rec. s':>13} {'max rec. s':>10} {'rebooted':>8} {'median down s':>13}"
    )
    for kind, k in summary.kinds.items():
        median = "-" if k.median_recovery_s is None else f"{k.median_recovery_s:.1f}"
        worst = "-" if k.max_recovery_s is None else f"{k.max_recovery_s:.1f}"
        down = "-" if k.median_device_downtime_s is None else f"{k.median_device_downtime_s:.1f}"
        print(
            f"{kind:<20} {k.injected:>8} {k.recovered:>9} {k.items_requeued:>8} "
            f"{median:>13} {worst:>10} {k.devices_rebooted:>8} {down:>13}"
        )
    base = clean.result.mean_iteration_s
    print(
        f"mean iteration {r.mean_iteration_s:.2f} s with faults, {base:.2f} s without "
        f"({r.mean_iteration_s / base:.2f}x); fault-free run lost {clean.lost}"
    )
    out = {
        "bench": "fault_soak",
        "mode": args.mode,
        "iterations": summary.iterations,
        "samples": summary.samples,
        "samples_expected": summary.samples_expected,
        "lost": summary.lost,
        "duplicated": summary.duplicated,
        "kinds": msgspec.to_builtins(summary.kinds),
        "mean_iteration_s": round(r.mean_iteration_s, 2),
        "fault_free_mean_iteration_s": round(base, 2),
        "wall_s": round(r.wall_s, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
