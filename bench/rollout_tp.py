"""The reference settings at other rollout tensor-parallel sizes: what the rollout's ``tp``
buys each mode, measured side by side.

The reference settings run the rollout at ``tp`` 1 / 2 / 4 (1.5B / 7B / 32B), half the
trainer's and inference's. A decode step costs a fixed part (a launch overhead, the
weights read split ``tp`` ways, the all-reduces) plus a part per token of context read,
so an engine of twice the ``tp`` decodes each of its requests faster and holds more
KV, while a full batch yields fewer tokens per device (the overhead is paid by half as
many requests per device). Which wins depends on how much of the rollout runs in thin
batches -- the long responses' tail. This bench runs every row with the rollout at
``tp`` times each factor (``--factors 1,2``; 1 is the reference setting), every mode in
``--modes`` (dynamic and both static modes), over ``--seeds`` workload seeds, and
prints per row and factor each mode's mean iteration (min-max over the seeds), its
throughput, the lower bound at that ``tp`` and dynamic's ratio over the better static
mode at that ``tp``; then per row the best factor of each mode, and dynamic at the
reference ``tp`` against the best static mode at *any* factor (a static placement
whose ``tp`` was chosen well). Last, one JSON line ``{"bench": "rollout_tp", "rows":
[...]}``.

Every engine runs at the one size (``rollout.tail_tp=0``: no regroup for the tail,
which the reference settings' dynamic mode may otherwise make).

``--rows`` picks rows by name (math-7b-128,...), ``--jobs`` runs that many simulations
at once. Every simulation is deterministic, so the figures do not depend on the
machine; only the wall time does.
"""

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from recipes.paper import _TP, SIZES, Size

from dynarl.sim.run import ModeResult
from sim_paper import STATIC, Setting, Workload, pick_rows, run_one

MODES = ("dynamic", *STATIC)


def _job(args: tuple[Workload, Size, int, str, int, int, int]) -> ModeResult:
    w, s, n, mode, tp, iterations, seed = args
    # Every engine at one size: the recipe's tail size is left out.
    overrides = (f"rollout.tp={tp}", "rollout.tail_tp=0")
    return run_one(w, s, n, mode, iterations=iterations, seed=seed, overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--factors", default="1,2", help="rollout tp multiples, e.g. 1,2,4")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run")
    parser.add_argument("--rows", default="", help="rows by name, e.g. math-7b-128")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds per mode")
    parser.add_argument("--iterations", type=int, default=2, help="per run, the first is warm-up")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    args = parser.parse_args()
    factors = [int(f) for f in args.factors.split(",")]
    modes = args.modes.split(",")
    statics = [m for m in modes if m in STATIC]
    if "dynamic" not in modes or not statics:
        parser.error("--modes needs dynamic and at least one static mode")
    every: list[Setting] = [
        (w, s, n) for w in ("math", "agentic") for n in (64, 128) for s in SIZES
    ]
    settings = pick_rows(parser, every, args.rows)
    seeds = range(args.seeds)
    jobs = [
        (w, s, n, m, _TP[s][1] * f, args.iterations, k)
        for w, s, n in settings
        for f in factors
        for m in modes
        for k in seeds
        if n % (_TP[s][1] * f) == 0
    ]
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=args.jobs)
    futures = {job: pool.submit(_job, job) for job in jobs}
    print(
        f"{'setting':<17} {'tp':>3} {'mode':<21} {'iter s':>8} {'spread s':>15} "
        f"{'throughput':>11} {'lower s':>8} {'gap':>5}"
    )
    rows = []
    for w, s, n in settings:
        name = f"{w}-{s}-{n}"
        base_tp = _TP[s][1]
        per_tp: dict[int, dict[str, list[ModeResult]]] = {}
        for f in factors:
            tp = base_tp * f
            if n % tp:
                continue
            per_tp[tp] = {
                m: [futures[(w, s, n, m, tp, args.iterations, k)].result() for k in seeds]
                for m in modes
            }
        mean_s = {
            tp: {m: statistics.fmean(r.mean_iteration_s for r in rs) for m, rs in runs.items()}
            for tp, runs in per_tp.items()
        }
        tput = {
            tp: {m: statistics.fmean(r.throughput for r in rs) for m, rs in runs.items()}
            for tp, runs in per_tp.items()
        }
        ratio: dict[int, float] = {}
        for tp, runs in per_tp.items():
            lower = statistics.fmean(r.lower_bound_s for r in runs["dynamic"])
            for m, rs in runs.items():
                lo = min(r.mean_iteration_s for r in rs)
                hi = max(r.mean_iteration_s for r in rs)
                print(
                    f"{name:<17} {tp:>3} {m:<21} {mean_s[tp][m]:>8.1f} "
                    f"{f'{lo:.1f}-{hi:.1f}':>15} {tput[tp][m]:>11.1f} {lower:>8.1f} "
                    f"{mean_s[tp][m] / lower - 1:>5.0%}"
                )
            ratio[tp] = tput[tp]["dynamic"] / max(tput[tp][st] for st in statics)
            print(f"{'':<17} {tp:>3} dynamic / best static at this tp = {ratio[tp]:.2f}x")
        best_tp = {m: max(per_tp, key=lambda tp, m=m: tput[tp][m]) for m in modes}
        best_static = max(
            ((tp, st) for tp in per_tp for st in statics), key=lambda x: tput[x[0]][x[1]]
        )
        vs_any = tput[base_tp]["dynamic"] / tput[best_static[0]][best_static[1]]
        best_dyn = tput[best_tp["dynamic"]]["dynamic"] / tput[best_static[0]][best_static[1]]
        print(
            f"{'':<17} best tp: "
            + ", ".join(f"{m} {best_tp[m]}" for m in modes)
            + f"; dynamic at tp {base_tp} / best static at any tp ({best_static[1]}, tp "
            f"{best_static[0]}) = {vs_any:.2f}x; dynamic at its best tp / that = {best_dyn:.2f}x",
            flush=True,
        )
        rows.append(
            {
                "setting": name,
                "reference_tp": base_tp,
                "mean_iteration_s": {
                    str(tp): {m: round(v, 2) for m, v in ms.items()} for tp, ms in mean_s.items()
                },
                "throughput": {
                    str(tp): {m: round(v, 3) for m, v in ts.items()} for tp, ts in tput.items()
                },
                "lower_bound_s": {
                    str(tp): round(statistics.fmean(r.lower_bound_s for r in runs["dynamic"]), 2)
                    for tp, runs in per_tp.items()
                },
                "speedup_vs_best_static": {str(tp): round(x, 3) for tp, x in ratio.items()},
                "best_tp": best_tp,
                "best_static": {"mode": best_static[1], "tp": best_static[0]},
                "dynamic_vs_best_static_any_tp": round(vs_any, 3),
                "best_dynamic_vs_best_static_any_tp": round(best_dyn, 3),
                "seeds": len(seeds),
            }
        )
    pool.shutdown()
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    print(json.dumps({"bench": "rollout_tp", "rows": rows}))


if __name__ == "__main__":
    main()
