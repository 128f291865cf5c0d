"""How fast the simulator itself runs: wall seconds per simulated iteration of 8,192
sequences on 128 devices (aim: < 10 s), with the real controller in the loop.

Prints a table per mode and one JSON line with ``sim_s_per_iteration`` (the slowest
mode's wall seconds per iteration).
"""

import argparse
import asyncio
import json

from recipes.paper import paper_setting

from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.run import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--size", default="1.5b", choices=("1.5b", "7b", "32b"))
    args = parser.parse_args()
    worst = 0.0
    per_mode = {}
    print(f"{'mode':<22} {'iterations':>10} {'wall s':>8} {'s/iteration':>12} {'virtual s':>10}")
    for mode in ("static-colocated", "static-disaggregated", "dynamic"):
        cfg = paper_setting("math", args.size, 128, mode=mode, num_iterations=args.iterations)  # type: ignore[arg-type]
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            result, _ = runner.run(simulate(cfg))
        per_it = result.wall_s / args.iterations
        virtual = sum(r.duration_s for r in result.iterations)
        worst = max(worst, per_it)
        per_mode[mode] = round(per_it, 3)
        print(
            f"{mode:<22} {args.iterations:>10} {result.wall_s:>8.2f} {per_it:>8.2f} "
            f"{virtual:>10.1f}"
        )
    print(
        json.dumps(
            {"bench": "sim_speed", "sim_s_per_iteration": round(worst, 3), "per_mode": per_mode}
        )
    )


if __name__ == "__main__":
    main()
