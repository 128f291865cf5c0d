"""What engines of a larger tensor-parallel size for the rollout's tail would buy, in
the simulator's model: the tail floor (``dynarl.sim.tail_floor``) of each reference
setting with the longest responses decoded on engines of 1x, 2x and 4x the rollout's
``tp`` (``tail_floor_s(..., tail_tp=...)``), the rest of the work on the rollout's own.

A decode step costs a fixed part (the step overhead and the weights read, split ``tp``
ways, plus the all-reduces when ``tp > 1``) and a part per token of context read. The
longest responses decode in thin batches, so the fixed part is most of their time, and
a larger ``tp`` shortens it -- RollPacker's elastic parallelism for its long rounds --
while each such engine holds that many more devices for as long. This is a model
estimate on freshly drawn workloads (``--seeds`` workload seeds, the recipe's
generator; not the table's measured iterations), with the same assumptions as the tail
floor: lengths known, no moves, KV capacity ignored.

Prints a table (lower bound, the floor at each tail ``tp``, the best one's gain over the
rollout's own) and one JSON line ``{"bench": "tail_tp", "rows": [...]}``.
"""

import argparse
import json
import statistics

import numpy as np
from recipes.paper import SIZES, paper_setting

from dynarl.sim.bound import work_conserving_bound
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import simulated_run
from dynarl.sim.tail_floor import tail_floor_s

FACTORS = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3, help="workloads drawn per setting")
    args = parser.parse_args()
    rows = []
    print(
        f"{'setting':<17} {'tp':>3} {'lower s':>8} "
        + " ".join(f"{f'floor x{f}':>9}" for f in FACTORS)
        + f" {'best':>5} {'gain':>6}"
    )
    for workload in ("math", "agentic"):
        for devices in (64, 128):
            for size in SIZES:
                run = simulated_run(paper_setting(workload, size, devices), [])
                cluster = build_cluster(run)
                tp = cluster.engine.tp
                floors: dict[int, list[float]] = {f: [] for f in FACTORS}
                lower: list[float] = []
                for seed in range(args.seeds):
                    rng = np.random.default_rng(run.job.run.seed + seed)
                    requests = cluster.workload.generate(rng)
                    lower.append(work_conserving_bound(cluster, requests, devices).lower_bound_s)
                    for f in FACTORS:
                        floors[f].append(tail_floor_s(cluster, requests, devices, tail_tp=f * tp))
                means = {f: statistics.fmean(v) for f, v in floors.items()}
                best = min(FACTORS, key=lambda f: means[f])
                gain = means[1] / means[best]
                name = f"{workload}-{size}-{devices}"
                print(
                    f"{name:<17} {tp:>3} {statistics.fmean(lower):>8.1f} "
                    + " ".join(f"{means[f]:>9.1f}" for f in FACTORS)
                    + f" {f'x{best}':>5} {gain:>5.3f}x"
                )
                rows.append(
                    {
                        "setting": name,
                        "rollout_tp": tp,
                        "lower_bound_s": round(statistics.fmean(lower), 2),
                        "tail_floor_s": {str(f * tp): round(means[f], 2) for f in FACTORS},
                        "best_tail_tp": best * tp,
                        "gain": round(gain, 4),
                    }
                )
    print(json.dumps({"bench": "tail_tp", "seeds": args.seeds, "rows": rows}))


if __name__ == "__main__":
    main()
