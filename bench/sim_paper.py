"""The reference tables in the simulator: math and agentic RL, 1.5B/7B/32B, 64 and 128
H100s, every scheduling mode on the same workloads, over several seeds.

For each setting it prints, per mode, the mean iteration time over the seeds with its
spread (min-max), the throughput (tokens/s for math, requests/s for agentic), how far
the mode stays above the setting's **lower bound** (the larger of the work-conserving
bound and the critical path: the longest request decoded alone, then scored and
trained, then the weight sync), how far above the **tail floor** (a model estimate,
not a bound: the longest responses decoded on engines of their own, paying for their
KV reads, then the last minibatch -- the longest groups -- on every device; see
``dynarl.sim.tail_floor``) and the scheduler's online overhead (wall-clock
seconds deciding over simulated seconds); then dynamic's speedup over the better
static mode beside the reference system's range, and on how many seeds dynamic is
ahead. ``plan err`` is how far the plans the mode committed predicted the iteration's end
(:mod:`dynarl.sim.plan_accuracy`): the median relative error over the seeds and the 90th
percentile of its magnitude (JSON ``plan_error``, for the modes that score their plans).
The last column is the wall-clock seconds one simulation of the mode took (the mean
over the seeds; JSON ``wall_s``): where the table's own run time goes. Under each row,
where dynamic's and the better static mode's time above the work-conserving bound went
(``ModeResult.gap_s``, the mean over the seeds; JSON ``gap_s``): each component's busy
time beyond the bound's useful work (a rollout's thin batches and re-prefills,
data-parallel loss), devices moving, and devices held idle.
``--reference-baselines`` also runs the static modes as the reference system's
baselines run, without request-level balancing (``rollout.balance=none``: no engine
takes a share of another's requests), as modes named ``static-colocated/none`` and so
on, and prints dynamic's speedup over the better of those (JSON:
``speedup_vs_unbalanced_static``, ``speedup_per_seed_unbalanced``): a like-for-like
reading of the reference's ratios, whose static modes keep requests where they were
first placed. Last, one JSON line: ``{"bench": "sim_paper", "rows": [...]}``, each row's
throughputs and iteration times the means over the seeds.

``--rows math-1.5b-64,agentic-7b-128`` picks rows, ``--quick`` the 64-device math
rows, ``--seeds`` the number of seeds (3), ``--jobs`` runs that many simulations at
once.
"""

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
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
STATIC = ("static-colocated", "static-disaggregated")
Workload = Literal["math", "agentic"]
Setting = tuple[Workload, Size, int]


def run_one(
    workload: Workload,
    size: Size,
    devices: int,
    mode: str,
    *,
    iterations: int,
    seed: int,
    overrides: tuple[str, ...] = (),
) -> ModeResult:
    """One simulation: ``mode`` (``dynamic+priority``: dynamic, priority order;
    ``MODE/none``: MODE with ``rollout.balance=none``) on a reference setting, with
    ``seed`` added to the recipe's seed and ``overrides`` (``KEY=VALUE``) applied last."""
    named, _, balance = mode.partition("/")
    base, _, extra = named.partition("+")
    cfg = paper_setting(workload, size, devices, mode=base, num_iterations=iterations)  # type: ignore[arg-type]
    settings = [f"run.seed={cfg.job.run.seed + seed}"]
    if extra == "priority":
        settings.append("sim.request_order=priority")
    if balance:
        settings.append(f"rollout.balance={balance}")
    cfg = simulated_run(cfg, [*settings, *overrides])
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(cfg, name=mode))
    return result


def pick_rows(parser: argparse.ArgumentParser, settings: list[Setting], rows: str) -> list[Setting]:
    """The ``settings`` ``rows`` names (comma-separated, like math-1.5b-64; all if
    empty); a name that matches none is the parser's error."""
    if not rows:
        return settings
    wanted = set(rows.split(","))
    picked = [x for x in settings if f"{x[0]}-{x[1]}-{x[2]}" in wanted]
    if not picked:
        parser.error(f"no row named {rows!r} (rows look like math-1.5b-64)")
    return picked


def _plan_error(results: list[ModeResult]) -> dict[str, float]:
    """How far a mode's committed plans predicted the iteration's end, over its seeds:
    the mean of the seeds' median relative errors, the largest of their 90th
    percentiles of the error's magnitude, and the plans scored in all (``plans`` 0: the
    mode scores no plans)."""
    scored = [r.plan_accuracy for r in results if r.plan_accuracy.plans]
    if not scored:
        return {"median": 0.0, "p90_abs": 0.0, "plans": 0}
    return {
        "median": round(statistics.fmean(a.median for a in scored), 3),
        "p90_abs": round(max(a.p90_abs for a in scored), 3),
        "plans": sum(a.plans for a in scored),
    }


def _job(args: tuple[Workload, Size, int, str, int, int]) -> ModeResult:
    w, s, n, mode, iterations, seed = args
    return run_one(w, s, n, mode, iterations=iterations, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=2, help="per run, the first is warm-up")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds per mode")
    parser.add_argument("--quick", action="store_true", help="64-device math rows only")
    parser.add_argument("--sizes", default=",".join(SIZES), help="model sizes, e.g. 1.5b,7b")
    parser.add_argument("--rows", default="", help="rows by name, e.g. math-1.5b-64,agentic-7b-128")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    parser.add_argument(
        "--reference-baselines",
        action="store_true",
        help="also run the static modes without request-level balancing (rollout.balance=none)",
    )
    args = parser.parse_args()
    settings: list[Setting] = [
        (w, s, n)
        for w in (("math",) if args.quick else ("math", "agentic"))
        for n in ((64,) if args.quick else (64, 128))
        for s in SIZES
        if s in args.sizes.split(",")
    ]
    settings = pick_rows(parser, settings, args.rows)
    seeds = range(args.seeds)

    def modes_of(w: Workload) -> tuple[str, ...]:
        modes = MATH_MODES if w == "math" else AGENTIC_MODES
        if args.reference_baselines:
            modes += tuple(f"{m}/none" for m in modes if not m.startswith("dynamic"))
        return modes

    jobs = [
        (w, s, n, m, args.iterations, k) for w, s, n in settings for m in modes_of(w) for k in seeds
    ]
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=args.jobs)
    futures = {job: pool.submit(_job, job) for job in jobs}
    header = (
        f"{'setting':<16} {'mode':<26} {'throughput':>12} {'iter s':>8} {'spread s':>13} "
        f"{'lower s':>8} {'gap':>6} {'floor s':>8} {'gap':>6} {'migr':>5} {'overhead':>9} "
        f"{'plan err':>11} {'wall s':>7}"
    )
    print(header, flush=True)
    rows = []
    for w, s, n in settings:
        name = f"{w}-{s}-{n}"
        modes = modes_of(w)
        runs = {
            m: [futures[(w, s, n, m, args.iterations, k)].result() for k in seeds] for m in modes
        }
        lower = statistics.fmean(r.lower_bound_s for r in runs["dynamic"])
        bound = statistics.fmean(r.bound_s for r in runs["dynamic"])
        floor = statistics.fmean(r.tail_floor_s for r in runs["dynamic"])
        mean_s = {m: statistics.fmean(r.mean_iteration_s for r in rs) for m, rs in runs.items()}
        tput = {m: statistics.fmean(r.throughput for r in rs) for m, rs in runs.items()}
        accuracy = {m: _plan_error(rs) for m, rs in runs.items()}
        for m, rs in runs.items():
            lo, hi = min(r.mean_iteration_s for r in rs), max(r.mean_iteration_s for r in rs)
            acc = accuracy[m]
            err = f"{acc['median']:+.0%}/{acc['p90_abs']:.0%}" if acc["plans"] else "-"
            print(
                f"{name:<16} {m:<26} {tput[m]:>12.1f} {mean_s[m]:>8.1f} "
                f"{f'{lo:.1f}-{hi:.1f}':>13} {lower:>8.1f} {mean_s[m] / lower - 1:>6.0%} "
                f"{floor:>8.1f} {mean_s[m] / floor - 1:>6.0%} "
                f"{statistics.fmean(r.num_migrations for r in rs):>5.0f} "
                f"{statistics.fmean(r.overhead for r in rs):>9.2%} {err:>11} "
                f"{statistics.fmean(r.wall_s for r in rs):>7.1f}"
            )

        per_seed = [
            runs["dynamic"][k].throughput / max(runs[st][k].throughput for st in STATIC)
            for k in seeds
        ]
        best_static = max(tput[st] for st in STATIC)
        ratio = tput["dynamic"] / best_static
        ahead = sum(x > 1.0 for x in per_seed)
        line = f"{'':<16} dynamic / best static = {ratio:.2f}x"
        line += f" (ahead on {ahead}/{len(per_seed)} seeds)"
        if w == "math":
            line += f"; dynamic / rlhfuse = {tput['dynamic'] / tput['rlhfuse']:.2f}x"
        else:
            prio = tput["dynamic+priority"] / best_static
            line += f"; dynamic+priority / best static = {prio:.2f}x"
        print(f"{line}   (reference {REFERENCE[(w, s)]})", flush=True)
        gap = {
            m: {c: statistics.fmean(r.gap_s[c] for r in rs) for c in rs[0].gap_s}
            for m, rs in runs.items()
        }
        closest = min(STATIC, key=lambda st: mean_s[st])
        for m in ("dynamic", closest):
            causes = ", ".join(f"{c} {v:+.1f}" for c, v in gap[m].items() if abs(v) >= 0.05)
            print(f"{'':<16} {m} above the bound, s: {causes}", flush=True)
        unbalanced: dict[str, object] = {}
        if args.reference_baselines:
            plain = [f"{st}/none" for st in STATIC]
            per_seed_none = [
                runs["dynamic"][k].throughput / max(runs[st][k].throughput for st in plain)
                for k in seeds
            ]
            ratio_none = tput["dynamic"] / max(tput[st] for st in plain)
            ahead_none = sum(x > 1.0 for x in per_seed_none)
            print(
                f"{'':<16} dynamic / best static without request balancing = "
                f"{ratio_none:.2f}x (ahead on {ahead_none}/{len(per_seed_none)} seeds)",
                flush=True,
            )
            unbalanced = {
                "speedup_vs_unbalanced_static": round(ratio_none, 3),
                "speedup_per_seed_unbalanced": [round(x, 3) for x in per_seed_none],
            }
        rows.append(
            {
                "setting": name,
                "unit": runs["dynamic"][0].unit,
                "throughput": {m: round(v, 3) for m, v in tput.items()},
                "mean_iteration_s": {m: round(v, 2) for m, v in mean_s.items()},
                "bound_s": round(bound, 2),
                "bound_gap": {m: round(v / bound - 1, 3) for m, v in mean_s.items()},
                "lower_bound_s": round(lower, 2),
                "lower_bound_gap": {m: round(v / lower - 1, 3) for m, v in mean_s.items()},
                "tail_floor_s": round(floor, 2),
                "tail_floor_gap": {m: round(v / floor - 1, 3) for m, v in mean_s.items()},
                "gap_s": {m: {c: round(v, 2) for c, v in g.items()} for m, g in gap.items()},
                "seeds": len(per_seed),
                "iteration_s_range": {
                    m: [
                        round(min(r.mean_iteration_s for r in rs), 2),
                        round(max(r.mean_iteration_s for r in rs), 2),
                    ]
                    for m, rs in runs.items()
                },
                "speedup_vs_best_static": round(ratio, 3),
                "speedup_per_seed": [round(x, 3) for x in per_seed],
                "overhead": {
                    m: round(statistics.fmean(r.overhead for r in rs), 5) for m, rs in runs.items()
                },
                "wall_s": {
                    m: round(statistics.fmean(r.wall_s for r in rs), 2) for m, rs in runs.items()
                },
                "plan_error": {m: acc for m, acc in accuracy.items() if acc["plans"]},
                "reference": REFERENCE[(w, s)],
                **unbalanced,
            }
        )
    pool.shutdown()
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    print(json.dumps({"bench": "sim_paper", "rows": rows}))


if __name__ == "__main__":
    main()
