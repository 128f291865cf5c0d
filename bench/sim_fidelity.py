"""How far the simulator is from the real CPU job: both side by side, in one run.

The real job is ``bench/e2e_cpu.py``'s (recipe :func:`recipes.e2e_cpu`: 2 one-thread
CPU slots, 32 prompts x 8 samples, responses up to 384 tokens), run for real under
``static-colocated``, ``static-disaggregated`` and ``dynamic``, opened side by side with
their iterations interleaved (so the shared machine's drift hits every mode alike).
Each mode's run directory holds its ``trace.jsonl``; the simulator then replays that
trace (the same prompts and response lengths, iteration by iteration) under the same
mode and configuration, and the mean iteration time and generated tokens/s over the
iterations after the warm-up are compared.

The simulated device is, by default, a profile measured in this process run: the
workers' costs (one round of ``bench/profile_cpu.py``) and the host-sharing curve
(:mod:`dynarl.workers.torch.host_scaling`), each measured before the runs and after
every round of iterations, averaged, and written to ``OUT/profile.json``. On a shared
machine a slot's speed moves with the other tenants' load by 2x and more within
minutes, and so does the host-sharing curve (two slots: 1.0x to 2.5x one alone), so
only a profile taken through the run describes the machine the run saw. The profile
also holds what the controller process (this one: every mode's controller, router and
reward) spends per response and per generated token, as every run records it
(``controller_cpu_per_request_s``, ``controller_cpu_per_token_s``: each iteration's
recorded CPU seconds fitted over the iterations after the warm-up, every mode, by
:func:`dynarl.sim.controller_cpu.fit_controller_cost`), and this host's cores
(``host_cores``): the simulator counts the controller as a fractional busy slot and
gives its controller's predictor the curve a real run's gets here.
``--profile builtin`` uses the built-in ``cpu-1t`` profile instead (measured once on
the development machine: a test of the built-in figures more than of the model).

Prints a table and one JSON line::

    {"bench": "sim_fidelity", "error": {mode: fraction}, "throughput_error": {...},
     "measured_s": {...}, "simulated_s": {...}, "ranking_agrees": bool,
     "separated_pairs": [[faster, slower], ...], "separated_pairs_kept": bool, ...}

where ``error`` is simulated over measured mean iteration time, minus one;
``iteration_errors`` the same per measured iteration (the replay runs each iteration's
own prompts and lengths) and ``error_interval`` a bootstrap 90% interval of ``error``
over those iterations (how far the real machine's noise leaves it uncertain); with the
measured profile, ``error_round_profile`` simulates each iteration on the profile
measured around its own round (the machine's drift between rounds then cancels out)
and ``error_round_profile_interval`` is its interval; ``stage_s`` gives per mode the
mean (real, simulated) seconds of the rollout and of the rest of the iteration after it
(which part an error is in), and ``engine_steps`` the mean (real, simulated) engine
steps an iteration by kind and the mean step of each kind in ms (whether the replay
takes the real engines' steps, and what one costs in each); ``separated_pairs`` are the
pairs of modes the real run tells apart (the mean log ratio of their paired
iterations has a 90% Student-t interval excluding 0: :mod:`fidelity_stats`) and
``separated_pairs_kept`` whether the replay orders every one of them so (the ranking
of modes the machine's noise cannot separate is no test of the replay)::

    python bench/sim_fidelity.py [--iterations 5] [--warmup 1] [--profile measured|builtin]
"""

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.predictor import usable_cores
from dynarl.control.topology import PROMPTS
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.obs.metrics import EngineSteps
from dynarl.sim.cluster import trace_workload
from dynarl.sim.config import SimConfig, SimulatedRun, simulated_run
from dynarl.sim.controller_cpu import ControllerCost, fit_controller_cost
from dynarl.sim.cpu_device import CPU_1T, CpuProfile
from dynarl.sim.cpu_profile import cpu_cluster
from dynarl.sim.profile_file import (
    MEASURED,
    PROFILE_VERSION,
    ProfileFile,
    profile_from,
    write_profile,
)
from dynarl.sim.run import ModeResult, simulate
from dynarl.workers.torch.host_scaling import SlotPool
from dynarl.workers.torch.profiling import measure as measure_costs
from e2e_cpu import MODES, ModeRun, mode_config, open_run, step, summarise
from fidelity_stats import (
    error_interval,
    paired_errors,
    ranking,
    separated_pairs,
    stage_split,
    step_split,
)

Mode = TypeVar("Mode", bound=str)


class Profiler:
    """Measures the workers' costs (one round of ``bench/profile_cpu.py``) and the
    host-sharing curve (a :class:`SlotPool` kept open through the run) on demand."""

    def __init__(self, cfg: DynaRLConfig) -> None:
        self.cfg = cfg
        threads = cfg.cluster.threads_per_device
        self.pool = SlotPool(cfg.model, cfg.rollout, cfg.cluster.num_devices, threads=threads)
        self.costs: list[dict[str, float]] = []
        self.curves: list[tuple[float, ...]] = []

    def __call__(self) -> None:
        """One round of both, now."""
        threads = self.cfg.cluster.threads_per_device
        self.costs.append(measure_costs(self.cfg, repeat=1, threads=threads))
        self.curves.append(self.pool.curve())
        print(
            f"profiled: decode step {self.costs[-1]['decode_a_s'] * 1e3:.2f} ms, "
            f"host slowdown {self.curves[-1]}",
            flush=True,
        )

    def profile(self) -> CpuProfile:
        """One profile of the rounds' means."""
        return self._mean(self.costs, self.curves)

    def round_profiles(self) -> list[CpuProfile]:
        """Per round of iterations ``k``, a profile of the two rounds of profiling
        around it (before and after): the machine that round's iterations ran on."""
        return [
            self._mean(self.costs[k : k + 2], self.curves[k : k + 2])
            for k in range(len(self.costs) - 1)
        ]

    @staticmethod
    def _mean(costs: list[dict[str, float]], curves: list[tuple[float, ...]]) -> CpuProfile:
        mean = {k: statistics.mean(c[k] for c in costs) for k in costs[0]}
        curve = tuple(round(statistics.mean(c), 3) for c in zip(*curves, strict=True))
        profile = profile_from(mean, name="cpu-measured")
        return msgspec.structs.replace(profile, host_slowdown=curve)


async def run_and_profile(
    runs: list[ModeRun], args: argparse.Namespace, profiler: Profiler | None
) -> None:
    """Open every mode's run side by side, then per round one iteration of each mode
    and (with a measured profile) one round of profiling, so the profile sees the same
    drift of the machine's load as the iterations. Each iteration's record holds the
    CPU seconds this process (the mode's controller, router and reward; the other
    modes' idle ones) spent on it (``controller_cpu_s``): what the host's cores run
    beside the mode's slots."""
    async with contextlib.AsyncExitStack() as stack:
        for run in runs:
            await open_run(stack, run)
        for _ in range(args.iterations):
            for run in runs:
                await step(run, args.iteration_limit_s)
            if profiler is not None:
                # in a thread: the open runs' controllers keep being served meanwhile
                await anyio.to_thread.run_sync(profiler)


def controller_cost(runs: list[ModeRun], warmup: int) -> ControllerCost:
    """The controller's CPU per response and per generated token, fitted over every
    mode's iterations after ``warmup`` (:func:`fit_controller_cost`, as
    ``dynarl profile --from-run`` fits one run's)."""
    return fit_controller_cost(s for r in runs for s in r.stats[warmup:])


class ReplayParts:
    """A controller listener on a replay: each iteration's start, its last rollout
    completion and its engines' steps (:class:`~dynarl.obs.metrics.EngineSteps`, as a
    real run's ``engine_steps``), so the replay's rollout, what follows it and its
    steps can be set against the real run's."""

    def __init__(self) -> None:
        self.start: dict[int, float] = {}
        self.rollout_end: dict[int, float] = {}
        self.steps: dict[int, dict[str, float]] = {}
        self._counter = EngineSteps()
        self._iteration = -1

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.IterationStarted):
            self._close()
            self._iteration = event.iteration
            self.start[event.iteration] = event.time_s
        elif isinstance(event, ev.ItemCompleted) and event.edge == PROMPTS:
            self.rollout_end[self._iteration] = event.time_s
        elif isinstance(event, ev.EngineStats):
            self._counter(event)
        elif isinstance(event, ev.IterationDone):
            self._close()

    def _close(self) -> None:
        steps = self._counter.take()
        if steps and self._iteration >= 0:
            self.steps[self._iteration] = steps

    def rollout_s(self) -> dict[int, float]:
        """Each iteration's rollout: its start to its last rollout completion."""
        return {k: end - self.start[k] for k, end in self.rollout_end.items() if k in self.start}


def simulate_mode(
    run: ModeRun, profile: CpuProfile, warmup: int, *, ends: ReplayParts | None = None
) -> ModeResult:
    """``run``'s job under its mode on ``profile``, replaying its own trace.jsonl
    (``ends`` hears the replay's events)."""
    trace = run.rl.run_dir / "trace.jsonl"
    num = len(run.stats)
    sim = simulated_run(
        SimulatedRun(job=run.cfg, sim=SimConfig(gpu="cpu-1t")),
        [
            f"sim.trace={json.dumps(str(trace))}",
            f"run.num_iterations={num}",
            f"sim.warmup_iterations={min(warmup, num - 1)}",
        ],
    )
    cluster = cpu_cluster(sim, profile=profile, workload=trace_workload(sim))
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(sim, cluster=cluster, name=run.mode, on_event=ends))
    return result


def iteration_times(result: ModeResult) -> dict[int, float]:
    """Each simulated iteration's time, by iteration."""
    return {r.iteration: r.end_s - r.start_s for r in result.iterations}


def simulate_rounds(run: ModeRun, profiles: list[CpuProfile], warmup: int) -> dict[int, float]:
    """Each measured iteration's simulated time on the profile measured around it (the
    replay of ``run`` on round ``k``'s profile, its iteration ``k``): the machine's
    drift between rounds, which hits every mode's iteration of a round alike, then
    cancels out of the comparison."""
    out = {}
    for k in range(warmup, min(len(run.stats), len(profiles))):
        times = iteration_times(simulate_mode(run, profiles[k], warmup))
        if k in times:
            out[k] = times[k]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out of means")
    parser.add_argument("--profile", choices=("measured", "builtin"), default="measured")
    parser.add_argument("--out", default="runs/sim_fidelity", help="parent of the run dirs")
    parser.add_argument("--iteration-limit-s", type=float, default=300.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="(the ranking needs 2+)"
    )
    args = parser.parse_args()
    args.quick, args.order = False, "interleaved"  # what e2e_cpu's helpers read
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    runs = [ModeRun(m, mode_config(m, args, out)) for m in args.modes]
    cfg0 = runs[0].cfg
    print(
        f"sim_fidelity: {cfg0.cluster.num_devices} slots x {cfg0.cluster.threads_per_device} "
        f"thread(s), {cfg0.algorithm.num_prompts}x{cfg0.algorithm.group_size} samples, "
        f"max_new_tokens {cfg0.rollout.max_new_tokens}, {args.iterations} iterations "
        f"(warm-up {args.warmup}), profile {args.profile}",
        flush=True,
    )
    t0 = time.perf_counter()
    profiler = Profiler(cfg0) if args.profile == "measured" else None
    try:
        if profiler is not None:
            profiler()
        asyncio.run(run_and_profile(runs, args, profiler))
    finally:
        if profiler is not None:
            profiler.pool.close()
    profile = profiler.profile() if profiler is not None else CPU_1T
    ctrl = controller_cost(runs, args.warmup)
    profile = msgspec.structs.replace(
        profile,
        controller_cpu_per_request_s=ctrl.per_request_s,
        controller_cpu_per_token_s=ctrl.per_token_s,
        host_cores=usable_cores(),
    )
    tenant = ("controller_cpu_per_request_s", "controller_cpu_per_token_s", "host_cores")
    out.mkdir(parents=True, exist_ok=True)
    profile_path = out / "profile.json"
    write_profile(
        profile_path,
        ProfileFile(
            profile_version=PROFILE_VERSION,
            device=profile,
            model=cfg0.model,
            measured=(*MEASURED, "host_slowdown", *tenant)
            if args.profile == "measured"
            else tenant,
            host=f"{platform.node()}, {os.cpu_count()} cores, measured by bench/sim_fidelity.py",
        ),
    )
    real = {r.mode: summarise(r, args.warmup) for r in runs}
    failed = {m: s["error"] for m, s in real.items() if s.get("error")}
    ends = {r.mode: ReplayParts() for r in runs}
    simulated = {
        r.mode: simulate_mode(r, profile, args.warmup, ends=ends[r.mode]) for r in runs if r.stats
    }

    measured_s = {m: real[m]["mean_iteration_s"] for m in simulated}
    simulated_s = {m: r.mean_iteration_s for m, r in simulated.items()}
    measured_tps = {m: real[m]["tokens_per_s"] for m in simulated}
    simulated_tps = {m: r.throughput for m, r in simulated.items()}
    error = {m: simulated_s[m] / measured_s[m] - 1.0 for m in simulated}
    tps_error = {m: simulated_tps[m] / measured_tps[m] - 1.0 for m in simulated}
    agrees = ranking(measured_s) == ranking(simulated_s)
    by_mode: dict[str, ModeRun] = {r.mode: r for r in runs}
    sim_times = {m: iteration_times(r) for m, r in simulated.items()}
    separated = separated_pairs({m: by_mode[m] for m in simulated}, args.warmup)
    kept = [(a, b) for a, b in separated if simulated_s[a] < simulated_s[b]]
    per_iteration = {m: paired_errors(by_mode[m], sim_times[m], args.warmup) for m in simulated}
    interval = {m: error_interval(by_mode[m], sim_times[m], args.warmup) for m in simulated}
    stages = {
        m: stage_split(by_mode[m], ends[m].rollout_s(), sim_times[m], args.warmup)
        for m in simulated
    }
    steps = {m: step_split(by_mode[m], ends[m].steps, args.warmup) for m in simulated}
    rounds: dict[str, dict[int, float]] = {}
    if profiler is not None:
        tenants = {k: getattr(profile, k) for k in tenant}
        per_round = [msgspec.structs.replace(p, **tenants) for p in profiler.round_profiles()]
        rounds = {m: simulate_rounds(by_mode[m], per_round, args.warmup) for m in simulated}
    round_error: dict[str, float] = {}
    for m, t in rounds.items():
        if t:
            measured_total = sum(by_mode[m].stats[k].elapsed_s for k in t)
            round_error[m] = sum(t.values()) / measured_total - 1.0

    print()
    print(
        f"{'mode':22s} {'real s':>7s} {'sim s':>7s} {'error':>7s} {'real tok/s':>10s} "
        f"{'sim tok/s':>10s} {'error':>7s} {'ctrl cpu s':>10s}"
    )
    cpu_s = {
        r.mode: statistics.mean(
            s.controller_cpu_s or 0.0 for s in r.stats[args.warmup :] or r.stats
        )
        for r in runs
        if r.stats
    }
    for m in simulated:
        print(
            f"{m:22s} {measured_s[m]:7.2f} {simulated_s[m]:7.2f} {error[m]:+7.1%} "
            f"{measured_tps[m]:10.0f} {simulated_tps[m]:10.0f} {tps_error[m]:+7.1%} "
            f"{cpu_s.get(m, math.nan):10.2f}"
        )
    for m in simulated:
        lo, hi = interval[m]
        shown = " ".join(f"{e:+.0%}" for e in per_iteration[m])
        print(f"{m:22s} error 90% interval {lo:+.1%} .. {hi:+.1%}; per iteration {shown}")
    for m, split in stages.items():
        shown = "; ".join(
            f"{part.replace('_', ' ')} real {r:.2f} s / sim {v:.2f} s ({v / r - 1:+.0%})"
            for part, (r, v) in split.items()
        )
        print(f"{m:22s} {shown}")
    for m, split in steps.items():
        if split:
            shown = "; ".join(
                f"{part.replace('_', ' ')} real {r:.1f} / sim {v:.1f} ({v / r - 1:+.0%})"
                for part, (r, v) in split.items()
            )
            print(f"{m:22s} engine steps an iteration: {shown}")
    for m, err in round_error.items():
        lo, hi = error_interval(by_mode[m], rounds[m], args.warmup)
        shown = " ".join(f"{e:+.0%}" for e in paired_errors(by_mode[m], rounds[m], args.warmup))
        print(
            f"{m:22s} on each round's own profile: error {err:+.1%} (90% interval "
            f"{lo:+.1%} .. {hi:+.1%}); per iteration {shown}"
        )
    print(
        f"ranking (fastest first): real {ranking(measured_s)}, simulated "
        f"{ranking(simulated_s)}: {'agrees' if agrees else 'DISAGREES'}"
    )
    told = ", ".join(f"{a} < {b}" for a, b in separated) or "none"
    print(
        f"pairs the real run tells apart (90%, paired by iteration): {told}; the replay "
        f"keeps {len(kept)} of {len(separated)}"
    )
    print(
        f"controller CPU: {ctrl.per_request_s * 1e3:.3f} ms per response + "
        f"{ctrl.per_token_s * 1e6:.1f} us per generated token (relative RMS residual: "
        f"fit {ctrl.rms_fit:.2f}, per token alone {ctrl.rms_per_token_only:.2f}, per "
        f"response alone {ctrl.rms_per_request_only:.2f}; {ctrl.mean_cpu_s:.3f} s, "
        f"{ctrl.mean_responses:.0f} responses, {ctrl.mean_tokens:.0f} tokens an "
        f"iteration), {profile.host_cores} cores"
    )
    print(
        f"profile: {profile.name}, decode step {profile.decode_step_s * 1e3:.2f} ms "
        f"(+{profile.step_dispatch_s * 1e3:.2f} ms worker loop), cache rebuild "
        f"{profile.join_per_held_token_s * 1e6:.3f}/{profile.leave_per_held_token_s * 1e6:.3f} "
        f"us per token held (join/leave), host slowdown {profile.host_slowdown}"
    )
    record: dict[str, Any] = {
        "bench": "sim_fidelity",
        "error": {m: round(v, 3) for m, v in error.items()},
        "throughput_error": {m: round(v, 3) for m, v in tps_error.items()},
        "error_interval": {m: [round(v, 3) for v in iv] for m, iv in interval.items()},
        "iteration_errors": {m: [round(v, 3) for v in e] for m, e in per_iteration.items()},
        "error_round_profile": {m: round(v, 3) for m, v in round_error.items()},
        "error_round_profile_interval": {
            m: [round(v, 3) for v in error_interval(by_mode[m], rounds[m], args.warmup)]
            for m in round_error
        },
        "stage_s": {
            m: {part: [round(r, 3), round(v, 3)] for part, (r, v) in split.items()}
            for m, split in stages.items()
        },
        "engine_steps": {
            m: {part: [round(r, 3), round(v, 3)] for part, (r, v) in split.items()}
            for m, split in steps.items()
        },
        "measured_s": {m: round(v, 3) for m, v in measured_s.items()},
        "simulated_s": {m: round(v, 3) for m, v in simulated_s.items()},
        "ranking_agrees": agrees,
        "separated_pairs": [list(p) for p in separated],
        "separated_pairs_kept": len(kept) == len(separated),
        "controller_cpu_s": {m: round(v, 3) for m, v in cpu_s.items()},
        "controller_cost": {k: round(v, 8) for k, v in msgspec.structs.asdict(ctrl).items()},
        "host_cores": profile.host_cores,
        "ranking": ranking(measured_s),
        "profile": args.profile,
        "host_slowdown": list(profile.host_slowdown),
        "num_devices": cfg0.cluster.num_devices,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "failed": failed,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(
        f"replay one: dynarl sim e2e_cpu --workload {out}/MODE/trace.jsonl --profile "
        f"{profile_path} --set scheduler.mode=MODE --set run.num_iterations={args.iterations}"
    )
    (out / "sim_fidelity.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    sys.exit(1 if failed or len(simulated) < len(runs) else 0)


if __name__ == "__main__":
    main()
