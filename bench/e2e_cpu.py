"""Dynamic vs static scheduling, measured for real on the CPU reference workers.

The same task, seed and devices (recipe :func:`recipes.e2e_cpu`) under ``dynamic``,
``static-colocated`` and ``static-disaggregated``, in one process. By default the three
runs are opened side by side and their iterations interleaved (mode A's iteration 0,
B's, C's, then A's iteration 1, ...), so slow drift of a shared, noisy machine hits
every mode alike; only one iteration runs at a time. Iteration 0 builds every role
(weights, first migrations) and is left out of the means (``--warmup``).

Per mode it reports generated tokens/s, mean iteration time, stage times, the share of
device time no component held (free or migrating), migrations and their cost, and the
learning curve (mean reward per iteration: scheduling must not change what is learned).
With ``--sim`` it also replays every iteration's measured response lengths through the
simulator with the CPU worker profile (:mod:`dynarl.sim.cpu_profile`) and prints the
predicted mean iteration time next to the measured one.

Ends with a table and one JSON line::

    python bench/e2e_cpu.py [--iterations 6] [--quick] [--sim] [--set key=value ...]
"""

import argparse
import asyncio
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from recipes import e2e_cpu

if TYPE_CHECKING:
    from dynarl.sim.run import ModeResult

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.control import events as ev
from dynarl.control.config import SchedulingMode
from dynarl.control.topology import PROMPTS
from dynarl.obs.metrics import IterationStats

MODES: tuple[SchedulingMode, ...] = ("dynamic", "static-colocated", "static-disaggregated")
COMPONENTS = ("rollout", "inference", "actor")


class TokenLog:
    """A controller listener: generated tokens of every finished rollout request, by
    iteration (the trace the simulator replays)."""

    def __init__(self) -> None:
        self.iteration = -1
        self.tokens: list[dict[str, int]] = []

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.IterationStarted):
            self.iteration = event.iteration
            self.tokens.append({})
        elif isinstance(event, ev.ItemCompleted) and event.edge == PROMPTS and self.tokens:
            self.tokens[-1][str(event.item)] = int(event.num_tokens)


class ModeRun:
    """One mode's open run and what it measured."""

    def __init__(self, mode: SchedulingMode, cfg: DynaRLConfig) -> None:
        self.mode = mode
        self.cfg = cfg
        self.rl = DynaRL(cfg)
        self.tokens = TokenLog()
        self.stats: list[IterationStats] = []
        self.open_s = 0.0
        self.error: str | None = None


def mode_config(mode: SchedulingMode, args: argparse.Namespace, out: Path) -> DynaRLConfig:
    """The recipe under ``mode`` with the command line's size and overrides."""
    sets = [f"run.run_dir={out / mode}", f"run.num_iterations={args.iterations}"]
    if args.quick:
        sets += [
            "algorithm.num_prompts=16",
            "algorithm.group_size=4",
            "rollout.max_new_tokens=128",
            "model.max_seq_len=256",
        ]
    return apply_overrides(e2e_cpu(mode), [*sets, *args.set])


async def open_run(stack: contextlib.AsyncExitStack, run: ModeRun) -> None:
    t0 = time.perf_counter()
    await stack.enter_async_context(run.rl)
    assert run.rl.controller is not None
    run.rl.controller.listeners.append(run.tokens)
    run.open_s = time.perf_counter() - t0
    print(f"[{run.mode}] open in {run.open_s:.1f} s", flush=True)


async def step(run: ModeRun, limit_s: float) -> None:
    """One iteration of ``run`` (a failure or a hang ends that mode, not the bench)."""
    if run.error is not None:
        return
    try:
        with anyio.fail_after(limit_s):
            s = await run.rl.step()
    except Exception as exc:
        run.error = f"iteration {len(run.stats)}: {type(exc).__name__}: {exc}"
        print(f"[{run.mode}] FAILED {run.error}", flush=True)
        return
    run.stats.append(s)
    stages = " ".join(f"{k} {v:.1f}" for k, v in s.stage_s.items())
    print(
        f"[{run.mode}] iter {s.iteration} reward {s.mean_reward:.3f} "
        f"{s.elapsed_s:.1f} s {s.tokens_per_s:.0f} tok/s ({s.gen_tokens} tokens, "
        f"mean {s.mean_response_tokens:.0f}) stages [{stages}] migrations "
        f"{len(s.migrations)} alloc {s.allocation}",
        flush=True,
    )


async def measure(runs: list[ModeRun], args: argparse.Namespace) -> None:
    if args.order == "interleaved":
        async with contextlib.AsyncExitStack() as stack:
            for run in runs:
                await open_run(stack, run)
            for _ in range(args.iterations):
                for run in runs:
                    await step(run, args.iteration_limit_s)
            for run in runs:
                save_timeline(run)
    else:
        for run in runs:
            async with contextlib.AsyncExitStack() as stack:
                await open_run(stack, run)
                for _ in range(args.iterations):
                    await step(run, args.iteration_limit_s)
                save_timeline(run)


def save_timeline(run: ModeRun) -> None:
    with contextlib.suppress(Exception):  # matplotlib is optional
        fig = run.rl.timeline_figure()
        fig.savefig(run.rl.run_dir / "timeline_bench.png", dpi=110)


def summarise(run: ModeRun, warmup: int) -> dict[str, Any]:
    """The mode's figures over its measured iterations (after ``warmup``)."""
    measured = run.stats[warmup:] or run.stats
    n = run.cfg.cluster.num_devices
    if not measured:
        return {"error": run.error}
    elapsed = sum(s.elapsed_s for s in measured)
    held = {c: sum(s.device_s.get(c, 0.0) for s in measured) for c in COMPONENTS}
    stage_names = sorted({k for s in measured for k in s.stage_s})
    return {
        "tokens_per_s": sum(s.gen_tokens for s in measured) / elapsed,
        "mean_iteration_s": elapsed / len(measured),
        "stage_s": {
            k: sum(s.stage_s.get(k, 0.0) for s in measured) / len(measured) for k in stage_names
        },
        "held_fraction": {c: held[c] / (n * elapsed) for c in COMPONENTS},
        "unheld_fraction": max(0.0, 1.0 - sum(held.values()) / (n * elapsed)),
        "migrations_per_iteration": sum(len(s.migrations) for s in measured) / len(measured),
        "migration_s_per_iteration": sum(m.duration_s for s in measured for m in s.migrations)
        / len(measured),
        "reward_curve": [round(s.mean_reward, 4) for s in run.stats],
        "iteration_s": [round(s.elapsed_s, 2) for s in run.stats],
        "gen_tokens": [s.gen_tokens for s in run.stats],
        "error": run.error,
    }


def profile_now(cfg: DynaRLConfig) -> dict[str, float]:
    """The CPU workers' costs measured now, in this process (see bench/profile_cpu.py):
    the machine is shared, so the profile is taken around the run it predicts."""
    from profile_cpu import measure as measure_costs

    t0 = time.perf_counter()
    costs = measure_costs(cfg, repeat=2, threads=cfg.cluster.threads_per_device)
    print(f"profiled the CPU workers in {time.perf_counter() - t0:.1f} s", flush=True)
    return costs


def save_raw(runs: list[ModeRun], path: Path, profile: dict[str, float]) -> None:
    """Every mode's iteration stats and token log, and the profile, for ``--replay``."""
    raw: dict[str, Any] = {"profile": profile}
    raw |= {
        r.mode: {
            "stats": msgspec.to_builtins(r.stats),
            "tokens": r.tokens.tokens,
            "error": r.error,
        }
        for r in runs
    }
    path.write_text(json.dumps(raw))


def load_raw(runs: list[ModeRun], path: Path) -> dict[str, float]:
    raw = json.loads(path.read_text())
    profile: dict[str, float] = raw.get("profile", {})
    for run in runs:
        if run.mode in raw:
            run.stats = msgspec.convert(raw[run.mode]["stats"], list[IterationStats])
            run.tokens.tokens = raw[run.mode]["tokens"]
            run.error = raw[run.mode]["error"]
    return profile


def simulate_modes(
    runs: list[ModeRun], warmup: int, measured: dict[str, float]
) -> dict[str, "ModeResult"]:
    """Predicted mean iteration time per mode: the simulator with the CPU profile
    (``measured`` around the run, else the built-in one), replaying the measured
    response lengths of each mode's own iterations."""
    from dynarl.core.virtual_time import VirtualTimeLoop
    from dynarl.sim.config import SimConfig, SimulatedRun, simulated_run
    from dynarl.sim.cpu_profile import cpu_cluster, replay_workload
    from dynarl.sim.run import simulate
    from profile_cpu import profile_from

    out: dict[str, ModeResult] = {}
    for run in runs:
        if not run.tokens.tokens:
            continue
        num = len(run.tokens.tokens)
        cfg = simulated_run(
            SimulatedRun(job=run.cfg, sim=SimConfig(gpu="cpu-1t")),
            [f"run.num_iterations={num}", f"sim.warmup_iterations={min(warmup, num - 1)}"],
        )
        workload = replay_workload(cfg.job, run.tokens.tokens)
        profile = profile_from(measured) if measured else None
        cluster = cpu_cluster(cfg, profile=profile, workload=workload)
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            result, _ = runner.run(simulate(cfg, cluster=cluster, name=run.mode))
        out[run.mode] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="3 iterations of a small batch")
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out of means")
    parser.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sim", action="store_true", help="also print the simulator's prediction")
    parser.add_argument("--out", default="runs/e2e_cpu", help="parent of the run directories")
    parser.add_argument("--iteration-limit-s", type=float, default=600.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--replay", metavar="RAW_JSON", help="summarise (and --sim) a saved raw.json, no run"
    )
    args = parser.parse_args()
    if args.quick:
        args.iterations = min(args.iterations, 3)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    out = Path(args.out)
    runs = [ModeRun(m, mode_config(m, args, out)) for m in args.modes]
    cfg0 = runs[0].cfg
    print(
        f"e2e_cpu: {cfg0.cluster.num_devices} devices x {cfg0.cluster.threads_per_device} "
        f"thread(s), {cfg0.algorithm.num_prompts}x{cfg0.algorithm.group_size} samples, "
        f"max_new_tokens {cfg0.rollout.max_new_tokens}, {args.iterations} iterations, "
        f"{args.order}",
        flush=True,
    )
    t0 = time.perf_counter()
    profile: dict[str, float] = {}
    if args.replay:
        profile = load_raw(runs, Path(args.replay))
    else:
        rounds = [profile_now(cfg0)] if args.sim else []
        asyncio.run(measure(runs, args))
        rounds += [profile_now(cfg0)] if args.sim else []
        profile = {k: statistics.mean(r[k] for r in rounds) for k in rounds[0]} if rounds else {}
        out.mkdir(parents=True, exist_ok=True)
        save_raw(runs, out / "raw.json", profile)
    wall_s = time.perf_counter() - t0
    summary = {r.mode: summarise(r, args.warmup) for r in runs}
    results = simulate_modes(runs, args.warmup, profile) if args.sim else {}
    predicted = {m: r.mean_iteration_s for m, r in results.items()}
    for mode, r in results.items():
        summary[mode]["sim_iteration_s"] = [round(it.duration_s, 2) for it in r.iterations]
        held = sum(c.held for c in r.devices.values()) + r.migration_device_s + r.free_device_s
        busy = sum(c.busy for c in r.devices.values())
        summary[mode]["sim_idle_fraction"] = 1.0 - busy / held if held > 0 else math.nan

    ok = {m: s for m, s in summary.items() if s.get("tokens_per_s")}
    print()
    print(
        f"{'mode':22s} {'tok/s':>7s} {'iter s':>7s} {'sim s':>7s} {'err':>6s} "
        f"{'rollout':>7s} {'score':>6s} {'train':>6s} {'sync':>5s} {'unheld':>6s} "
        f"{'migr/it':>7s}  reward curve"
    )
    for mode, s in ok.items():
        sim_s = predicted.get(mode, math.nan)
        err = sim_s / s["mean_iteration_s"] - 1.0
        st = s["stage_s"]
        print(
            f"{mode:22s} {s['tokens_per_s']:7.0f} {s['mean_iteration_s']:7.2f} "
            f"{sim_s:7.2f} {err:+6.0%} {st.get('rollout', 0):7.2f} {st.get('score', 0):6.2f} "
            f"{st.get('train', 0):6.2f} {st.get('sync', 0):5.2f} {s['unheld_fraction']:6.1%} "
            f"{s['migrations_per_iteration']:7.1f}  {s['reward_curve']}"
        )
    static = [
        ok[m]["tokens_per_s"] for m in ("static-colocated", "static-disaggregated") if m in ok
    ]
    speedup = ok["dynamic"]["tokens_per_s"] / max(static) if "dynamic" in ok and static else None
    record = {
        "bench": "e2e_cpu",
        "num_devices": cfg0.cluster.num_devices,
        "threads_per_device": cfg0.cluster.threads_per_device,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "order": args.order,
        "tokens_per_s": {m: round(s["tokens_per_s"], 1) for m, s in ok.items()},
        "mean_iteration_s": {m: round(s["mean_iteration_s"], 3) for m, s in ok.items()},
        "speedup_vs_best_static": None if speedup is None else round(speedup, 3),
        "unheld_fraction": {m: round(s["unheld_fraction"], 3) for m, s in ok.items()},
        "migrations_per_iteration": {m: s["migrations_per_iteration"] for m, s in ok.items()},
        "reward_curves": {m: s["reward_curve"] for m, s in ok.items()},
        "sim_mean_iteration_s": {m: round(v, 3) for m, v in predicted.items()},
        "sim_idle_fraction": {
            m: round(s["sim_idle_fraction"], 3) for m, s in ok.items() if "sim_idle_fraction" in s
        },
        "sim_error": {
            m: round(v / ok[m]["mean_iteration_s"] - 1.0, 3)
            for m, v in predicted.items()
            if m in ok
        },
        "errors": {m: s["error"] for m, s in summary.items() if s.get("error")},
        "wall_s": round(wall_s, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_cpu.json").write_text(json.dumps({"summary": summary, **record}, indent=1))
    print(json.dumps(record))
    sys.exit(0 if len(ok) == len(runs) else 1)


if __name__ == "__main__":
    main()
