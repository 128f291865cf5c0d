"""The reference tables in the simulator: math and agentic RL, 1.5B/7B/32B, 64 and 128
H100s, every scheduling mode on the same workload and seed.

For each setting it prints the throughput of each mode (tokens/s for math, requests/s
for agentic), dynamic's speedup over the better static mode beside the reference
system's range, and how far each mode stays above the work-conserving bound; then one
JSON line: ``{"bench": "sim_paper", "rows": [...]}``.
Takes a few minutes; ``--quick`` runs the 64-device math rows only.
"""

import argparse
import asyncio
import json
import time
from typing import Literal

from recipes.paper import SIZES, Size, paper_setting

from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import simulated_run
from dynarl.sim.run import ModeResult, simulate

REFERENCE = {
    ("math", "1.5b"): "1.43-1.55x",
    ("math", "7b"): "1.43-1.55x",
    ("math", "32b"): "1.27-1.98x",
    ("agentic", "1.5b"): "1.06-1.38x / 1.27-1.64x",
    ("agentic", "7b"): "1.06-1.38x / 1.27-1.64x",
    ("agentic", "32b"): "1.06-1.38x / 1.27-1.64x",
}
MATH_MODES = ("dynamic", "static-colocated", "static-disaggregated", "rlhfuse")
AGENTIC_MODES = ("dynamic", "dynamic+priority", "static-colocated", "static-disaggregated")


def run_one(
    workload: Literal["math", "agentic"], size: Size, devices: int, mode: str, iterations: int
) -> ModeResult:
    base, _, extra = mode.partition("+")
    cfg = paper_setting(workload, size, devices, mode=base, num_iterations=iterations)  # type: ignore[arg-type]
    if extra == "priority":
        cfg = simulated_run(cfg, ["sim.request_order=priority"])
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(cfg, name=mode))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=2, help="per run, the first is warm-up")
    parser.add_argument("--quick", action="store_true", help="64-device math rows only")
    parser.add_argument("--sizes", default=",".join(SIZES), help="model sizes, e.g. 1.5b,7b")
    args = parser.parse_args()
    settings: list[tuple[Literal["math", "agentic"], Size, int]] = [
        (w, s, n)
        for w in (("math",) if args.quick else ("math", "agentic"))
        for n in ((64,) if args.quick else (64, 128))
        for s in SIZES
        if s in args.sizes.split(",")
    ]
    rows = []
    t0 = time.perf_counter()
    header = (
        f"{'setting':<16} {'mode':<22} {'throughput':>12} {'iter s':>8} {'bound s':>8} "
        f"{'gap':>6} {'migr':>5}"
    )
    print(header)
    for workload, size, devices in settings:
        modes = MATH_MODES if workload == "math" else AGENTIC_MODES
        name = f"{workload}-{size}-{devices}"
        results = {m: run_one(workload, size, devices, m, args.iterations) for m in modes}
        for m, r in results.items():
            print(
                f"{name:<16} {m:<22} {r.throughput:>12.1f} {r.mean_iteration_s:>8.1f} "
                f"{r.bound_s:>8.1f} {r.bound_gap:>6.2f} {r.num_migrations:>5}"
            )
        best_static = max(
            results["static-colocated"].throughput, results["static-disaggregated"].throughput
        )
        ratio = results["dynamic"].throughput / best_static
        line = f"{'':<16} dynamic / best static = {ratio:.2f}x"
        if workload == "math":
            fuse = results["dynamic"].throughput / results["rlhfuse"].throughput
            line += f"; dynamic / rlhfuse = {fuse:.2f}x"
        else:
            prio = results["dynamic+priority"].throughput / best_static
            line += f"; dynamic+priority / best static = {prio:.2f}x"
        print(f"{line}   (reference {REFERENCE[(workload, size)]})")
        rows.append(
            {
                "setting": name,
                "unit": results["dynamic"].unit,
                "throughput": {m: round(r.throughput, 3) for m, r in results.items()},
                "mean_iteration_s": {m: round(r.mean_iteration_s, 2) for m, r in results.items()},
                "bound_s": round(results["dynamic"].bound_s, 2),
                "bound_gap": {m: round(r.bound_gap, 3) for m, r in results.items()},
                "speedup_vs_best_static": round(ratio, 3),
                "reference": REFERENCE[(workload, size)],
            }
        )
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    print(json.dumps({"bench": "sim_paper", "rows": rows}))


if __name__ == "__main__":
    main()
