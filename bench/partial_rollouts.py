"""What partial rollouts buy on the reference settings, and what they cost in staleness.

Partial rollouts (``algorithm.over_sample_prompts``, ``algorithm.max_staleness``; see
``dynarl.sim.partial``) run more groups than an iteration trains, end the rollout once
the groups it trains are whole and carry the unfinished ones over. This bench runs each
reference row (``recipes.paper``) on-policy and with each over-sampling and staleness
setting, in each mode, on the same workload seeds, side by side in one run. It prints,
per row, mode and setting: the mean iteration time over the measured iterations
(``--iterations``, of which ``--warmup`` are left out: a carried group needs a few
iterations to reach its steady state), the speedup over the same mode on-policy and
over the better of the row's on-policy static modes, the share of trained response
tokens that older weights generated (the staleness price: those tokens are up to
``max_staleness`` versions behind the weights that train on them) and the most times a
trained group was carried, then the scheduler's decision time (p99, ms) and online
overhead (decision wall-clock over simulated time). Last, one JSON line:
``{"bench": "partial_rollouts", "rows": [...]}``.

``--rows math-1.5b-64,agentic-7b-64`` picks rows, ``--over 128,512`` the
over-sampled groups (of the rows' 512 prompts), ``--staleness 1,4`` the bounds,
``--modes`` the modes, ``--seeds`` the workload seeds, ``--jobs`` simulations at once.
"""

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from recipes.paper import paper_setting

from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import simulated_run
from dynarl.sim.run import ModeResult, simulate


def run_one(
    row: str, mode: str, over: int, staleness: int, *, iterations: int, warmup: int, seed: int
) -> ModeResult:
    """One simulation of ``row`` (``math-1.5b-64``) in ``mode``; ``over`` 0: on-policy."""
    workload, size, devices = row.split("-")
    cfg = paper_setting(workload, size, int(devices), mode=mode, num_iterations=iterations)  # type: ignore[arg-type]
    overrides = [f"run.seed={cfg.job.run.seed + seed}", f"sim.warmup_iterations={warmup}"]
    if over:
        overrides += [
            f"algorithm.over_sample_prompts={over}",
            f"algorithm.max_staleness={staleness}",
        ]
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(simulated_run(cfg, overrides), name=mode))
    return result


def _job(job: tuple[str, str, int, int, int, int, int]) -> ModeResult:
    row, mode, over, staleness, iterations, warmup, seed = job
    return run_one(row, mode, over, staleness, iterations=iterations, warmup=warmup, seed=seed)


def _older_share(result: ModeResult, warmup: int) -> float:
    measured = result.iterations[warmup:]
    trained = sum(r.trained_tokens for r in measured)
    return sum(r.older_tokens for r in measured) / trained if trained else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="math-1.5b-64,math-7b-64,agentic-1.5b-64,agentic-7b-64")
    parser.add_argument("--modes", default="dynamic,static-colocated")
    parser.add_argument("--over", default="128,512", help="over-sampled groups per iteration")
    parser.add_argument("--staleness", default="1,4", help="max_staleness values")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    rows = args.rows.split(",")
    modes = args.modes.split(",")
    settings = [(0, 0)] + [
        (int(o), int(s)) for o in args.over.split(",") for s in args.staleness.split(",")
    ]
    seeds = range(args.seeds)
    jobs = [
        (row, mode, over, st, args.iterations, args.warmup, k)
        for row in rows
        for mode in modes
        for over, st in settings
        for k in seeds
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {job: pool.submit(_job, job) for job in jobs}
        print(
            f"{'setting':<16} {'mode':<18} {'rollouts':<18} {'iter s':>8} {'vs on-policy':>13} "
            f"{'vs best static':>15} {'older tokens':>13} {'carried':>8} {'p99 ms':>7} "
            f"{'overhead':>9}",
            flush=True,
        )
        out_rows = []
        for row in rows:
            res = {
                (m, o, s): [
                    futures[(row, m, o, s, args.iterations, args.warmup, k)].result() for k in seeds
                ]
                for m in modes
                for o, s in settings
            }
            mean_s = {
                key: statistics.fmean(r.mean_iteration_s for r in rs) for key, rs in res.items()
            }
            static = [m for m in modes if m.startswith("static")]
            best_static = min((mean_s[(m, 0, 0)] for m in static), default=float("nan"))
            cells = []
            for (m, o, s), rs in res.items():
                label = "on-policy" if not o else f"over {o}, stale {s}"
                older = statistics.fmean(_older_share(r, args.warmup) for r in rs)
                carried = max(
                    (x.max_times_carried for r in rs for x in r.iterations[args.warmup :]),
                    default=0,
                )
                p99 = max(r.decision_p99_ms for r in rs)
                overhead = statistics.fmean(r.overhead for r in rs)
                vs_self = mean_s[(m, 0, 0)] / mean_s[(m, o, s)]
                vs_static = best_static / mean_s[(m, o, s)]
                print(
                    f"{row:<16} {m:<18} {label:<18} {mean_s[(m, o, s)]:>8.1f} "
                    f"{vs_self:>12.2f}x {vs_static:>14.2f}x {older:>13.0%} {carried:>8} "
                    f"{p99:>7.1f} {overhead:>9.2%}",
                    flush=True,
                )
                cells.append(
                    {
                        "mode": m,
                        "over_sample_prompts": o,
                        "max_staleness": s,
                        "mean_iteration_s": round(mean_s[(m, o, s)], 2),
                        "speedup_vs_on_policy": round(vs_self, 3),
                        "speedup_vs_best_static_on_policy": round(vs_static, 3),
                        "older_token_share": round(older, 3),
                        "max_times_carried": carried,
                        "decision_p99_ms": round(p99, 2),
                        "overhead": round(overhead, 5),
                    }
                )
            out_rows.append({"setting": row, "seeds": len(seeds), "runs": cells})
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    print(json.dumps({"bench": "partial_rollouts", "rows": out_rows}))


if __name__ == "__main__":
    main()
