"""``dynarl sim``: simulate a job on a modelled cluster under one or more scheduling
modes and write a run directory (``config.yaml``, ``metrics.jsonl``, ``timeline.jsonl``
and pictures of it).

``--sweep KEY=V1,V2,...`` runs every mode at each value of a config key (repeated, at
each combination of the keys' values): the same workload at each point, so what a
setting buys each mode -- the rollout's ``tp``, the devices, the batch -- reads off
one table. Every point is resolved and checked before anything is simulated, so a
bad value costs nothing.
"""

import argparse
import asyncio
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from dynarl.api.config import DynaRLConfig
from dynarl.cli_sources import resolve_source
from dynarl.core.errors import ConfigError

SweepPoint = tuple[tuple[str, str], ...]
"""One point of a sweep: ``(key, value)`` per swept key, in the order given."""


def sweep_points(specs: Sequence[str]) -> list[SweepPoint]:
    """The points ``--sweep`` specs name: every combination of each key's values (one
    empty point without specs). Raises :class:`ConfigError` on a spec that is not
    ``KEY=V1,V2,...`` or a key swept twice."""
    axes: list[list[tuple[str, str]]] = []
    seen: set[str] = set()
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        items = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(items):
            raise ConfigError(
                f"--sweep {spec!r}: write KEY=V1,V2,... (e.g. --sweep rollout.tp=1,2,4)"
            )
        if key in seen:
            raise ConfigError(f"--sweep names {key} twice: list all its values in one --sweep")
        seen.add(key)
        axes.append([(key, v) for v in dict.fromkeys(items)])
    return [tuple(point) for point in itertools.product(*axes)]


def point_label(point: SweepPoint) -> str:
    """``key=value`` of each swept key, space-separated (empty for no sweep)."""
    return " ".join(f"{k}={v}" for k, v in point)


def sim_command(args: argparse.Namespace) -> int:
    """``dynarl sim``: run each mode (at each sweep point), print what each did, and
    write the run directory."""
    from dynarl.core.virtual_time import VirtualTimeLoop
    from dynarl.obs.timeline import TimelineRecorder
    from dynarl.sim.config import SimulatedRun, simulated_run
    from dynarl.sim.run import ModeResult, simulate

    base = resolve_source(args.config)
    if isinstance(base, msgspec.Struct) and not isinstance(base, DynaRLConfig | SimulatedRun):
        raise ConfigError(f"{args.config!r} is neither a run's nor a simulated run's config")
    sim_run = simulated_run(base, args.set)
    if args.profile:
        from dynarl.sim.profile_file import read_profile

        read_profile(args.profile)  # a bad file is refused before anything runs
        sim_run = simulated_run(sim_run, [f"sim.gpu={json.dumps(args.profile)}"])
    if args.workload:
        sim_run = simulated_run(sim_run, _workload_overrides(args.workload, sim_run))
    points = [
        (p, simulated_run(sim_run, [f"{k}={v}" for k, v in p])) for p in sweep_points(args.sweep)
    ]
    cfg, sim = sim_run.job, sim_run.sim
    modes = args.modes.split(",") if args.modes else [cfg.scheduler.mode]
    if args.compare:
        modes = ["dynamic", "static-colocated", "static-disaggregated"]
        modes.append("rlhfuse" if sim.workload == "math" else "dynamic+priority")
    run_dir = Path(args.out or cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(msgspec.to_builtins(sim_run), sort_keys=False)
    )
    title = _describe(sim_run)
    recorders: list[TimelineRecorder] = []
    table: dict[SweepPoint, dict[str, ModeResult]] = {}
    with (run_dir / "metrics.jsonl").open("wb") as metrics:
        for point, point_run in points:
            if point:
                print(f"-- {point_label(point)}")
            print(
                f"{'mode':<22} {'throughput':>14} {'mean iter s':>11} {'bound s':>8} "
                f"{'above bound':>11} {'migrations':>10} {'crit. path s':>12}"
            )
            table[point] = {}
            for mode in modes:
                name = f"{mode} {point_label(point)}".strip()
                mode_name, _, extra = mode.partition("+")
                mode_run = simulated_run(point_run, [f"scheduler.mode={mode_name}"])
                if extra:
                    mode_run = simulated_run(mode_run, [f"sim.request_order={extra}"])
                with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
                    result, recorder = runner.run(simulate(mode_run, name=name))
                recorders.append(recorder)
                table[point][mode] = result
                record: dict[str, Any] = {"run": name, "result": result}
                if point:
                    record["sweep"] = dict(point)
                metrics.write(msgspec.json.encode(record) + b"\n")
                _print_result(mode, result, partial=cfg.algorithm.partial_rollouts, sim=sim)
            _print_bound(list(table[point].values()))
    if len(points) > 1:
        _print_sweep(table, modes)
    _draw(run_dir, recorders, title)
    return 0


def _describe(sim_run: Any) -> str:
    """Print the run's one-line description; return the pictures' title."""
    from dynarl.sim.cpu_profile import cpu_profile

    cfg, sim = sim_run.job, sim_run.sim
    model = sim.model
    if cpu_profile(sim.gpu) is not None:
        m = cfg.model  # the CPU profile runs the model section's shape
        model = m.path or f"{m.arch} {m.num_layers}x{m.hidden_size} (model section)"
    device = sim.gpu
    if sim.gpu.lower().endswith(".json") or "/" in sim.gpu:
        device = f"{cpu_profile(sim.gpu).name} (profile {sim.gpu})"  # type: ignore[union-attr]
    workload = sim.workload if sim.trace is None else f"{sim.workload} trace {sim.trace}"
    print(
        f"simulating {workload} on {cfg.cluster.num_devices} x {device}, "
        f"{model}, {cfg.algorithm.samples_per_iteration} sequences/iteration, "
        f"{cfg.run.num_iterations} iterations ({sim.warmup_iterations} warm-up)"
    )
    return f"{sim.workload} {model} on {cfg.cluster.num_devices} x {device}"


def _print_result(mode: str, result: Any, *, partial: bool, sim: Any) -> None:
    """One mode's row of the table and the lines under it."""
    print(
        f"{mode:<22} {result.throughput:>10.1f} {result.unit.split('/')[0][:3]}/s "
        f"{result.mean_iteration_s:>11.1f} {result.bound_s:>8.1f} "
        f"{result.bound_gap:>10.0%} {result.num_migrations:>10} "
        f"{result.critical_path_s:>12.1f}"
    )
    busy = ", ".join(f"{c} {t.busy:.0f}/{t.held:.0f}" for c, t in result.devices.items() if t.held)
    print(f"{'':<22} busy/held device-s: {busy}")
    above = ", ".join(
        f"{cause} {secs:+.1f}" for cause, secs in result.gap_s.items() if abs(secs) >= 0.05
    )
    print(f"{'':<22} above the bound, s: {above}")
    acc = result.plan_accuracy
    if acc.plans:
        print(
            f"{'':<22} its {acc.plans} scored plans predicted the iteration's end "
            f"{acc.median:+.0%} (median; 90% within {acc.p90_abs:.0%})"
        )
    if partial:
        print(f"{'':<22} {_staleness(result, sim.warmup_iterations)}")


def _print_sweep(table: dict[SweepPoint, dict[str, Any]], modes: Sequence[str]) -> None:
    """The sweep's summary: each mode's mean iteration at each point, its best point
    (highest throughput) and that point's speedup over the first; then, with dynamic
    and a static mode among the modes, dynamic over the better static mode per point."""
    points = list(table)
    labels = [point_label(p) for p in points]
    width = max(12, *(len(x) for x in labels))
    print("sweep: mean iteration s per point; best: the point of highest throughput")
    print(f"{'mode':<22} " + " ".join(f"{x:>{width}}" for x in labels) + "  best")
    for mode in modes:
        cells = [table[p][mode] for p in points]
        best = max(range(len(points)), key=lambda i: cells[i].throughput)
        gain = cells[best].throughput / cells[0].throughput if cells[0].throughput else 0.0
        print(
            f"{mode:<22} "
            + " ".join(f"{c.mean_iteration_s:>{width}.1f}" for c in cells)
            + f"  {labels[best]} ({gain:.2f}x the first)"
        )
    statics = [m for m in modes if m.startswith("static-")]
    if "dynamic" in modes and statics:
        ratios = [
            table[p]["dynamic"].throughput / max(table[p][m].throughput for m in statics)
            for p in points
        ]
        print(f"{'dynamic / best static':<22} " + " ".join(f"{r:>{width - 1}.2f}x" for r in ratios))


def _draw(run_dir: Path, recorders: Sequence[Any], title: str) -> None:
    """Write the timeline and its pictures: every run on one, then one per run (on its
    own time axis) when there are several."""
    from dynarl.obs.plot import plot_timeline
    from dynarl.obs.timeline import read_timeline, write_timeline

    write_timeline(run_dir / "timeline.jsonl", recorders)
    lines = read_timeline(run_dir / "timeline.jsonl")
    plot_timeline(lines, run_dir / "timeline.png", title=title)
    pictures = ["timeline.png"]
    runs = list(dict.fromkeys(line.run for line in lines))
    if len(runs) > 1:
        for run in runs:
            name = f"timeline-{re.sub(r'[^A-Za-z0-9._=-]+', '-', run)}.png"
            mine = [line for line in lines if line.run == run]
            plot_timeline(mine, run_dir / name, title=f"{run}: {title}")
            pictures.append(name)
    print(f"wrote {run_dir}/: config.yaml, metrics.jsonl, timeline.jsonl, {', '.join(pictures)}")


def _staleness(result: Any, warmup: int) -> str:
    """What a simulated run's partial rollouts carried over, on its measured iterations."""
    measured = result.iterations[min(warmup, len(result.iterations) - 1) :]
    trained = sum(r.trained_tokens for r in measured)
    older = sum(r.older_tokens for r in measured) / trained if trained else 0.0
    carried = sum(r.carried_groups for r in measured) / len(measured)
    most = max(r.max_times_carried for r in measured)
    return (
        f"partial rollouts: {carried:.0f} groups carried on per iteration, {older:.0%} of "
        f"the trained response tokens from older weights, a group carried at most {most}x"
    )


def _print_bound(results: Sequence[Any]) -> None:
    """The row of the bound under the modes' table: the same iterations at the larger
    of the work-conserving bound and the critical path (the modes share the workload,
    so they share it; its throughput is the best any mode could reach)."""
    if not results:
        return
    r = results[0]
    work_per_iteration = r.throughput * r.mean_iteration_s
    throughput = work_per_iteration / r.lower_bound_s if r.lower_bound_s > 0 else 0.0
    print(
        f"{'lower bound':<22} {throughput:>10.1f} {r.unit.split('/')[0][:3]}/s "
        f"{r.lower_bound_s:>11.1f} {r.bound_s:>8.1f} {'':>11} {'':>10} "
        f"{r.critical_path_s:>12.1f}"
    )


def _workload_overrides(path: str, sim_run: Any) -> list[str]:
    """What replaying the trace at ``path`` sets: ``sim.trace``, the batch shape, the
    kind and (if the trace's longest request needs it) the length cap."""
    from dynarl.sim.replay import ReplayWorkload
    from dynarl.sim.traces import read_trace

    replay = ReplayWorkload.of_requests(read_trace(path).requests, source=path)
    cap = max(sim_run.job.rollout.max_new_tokens, replay.longest_output_tokens)
    return [
        f"sim.trace={json.dumps(path)}",
        f"sim.workload={'agentic' if replay.multi_turn else 'math'}",
        f"algorithm.num_prompts={replay.num_prompts}",
        f"algorithm.group_size={replay.group_size}",
        f"rollout.max_new_tokens={cap}",
    ]
