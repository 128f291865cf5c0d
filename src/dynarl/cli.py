"""The ``dynarl`` command line.

``dynarl demo`` runs the real controller under every scheduling mode against the
in-process fake pipeline on virtual time and prints what each mode did;
``dynarl sim`` runs the real controller against the calibrated cluster simulator under
several modes and writes a run directory (metrics, allocation timeline and its
picture); ``dynarl run`` trains for real (or ``--resume``s a run directory) with a
progress display; ``dynarl plot`` redraws a run directory's picture;
``dynarl config`` prints a resolved configuration; ``dynarl profile`` measures
this machine into a profile file ``dynarl sim --profile`` reads. The CLI is the application: it may
print and start event loops; the library never does.
"""

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.cli_sources import resolve_config, resolve_source
from dynarl.core.errors import ConfigError, DynaRLError

MODES = ("static-colocated", "static-disaggregated", "dynamic")


def _demo(args: argparse.Namespace) -> int:
    from dynarl.core.virtual_time import VirtualTimeLoop
    from dynarl.testing.harness import fake_profile, run_with_fake_world
    from dynarl.testing.world import FakeWorldConfig

    cfg = resolve_config(args.config, args.set)
    algo = cfg.algorithm
    world = FakeWorldConfig(
        num_prompts=algo.num_prompts,
        group_size=algo.group_size,
        n_minibatches=algo.n_minibatches,
        num_iterations=args.iterations,
        median_tokens=cfg.rollout.max_new_tokens / 4,
        max_tokens=cfg.rollout.max_new_tokens * 4,
        seed=cfg.run.seed,
    )
    profile = fake_profile(world, cfg.cluster.num_devices)
    print(
        f"fake pipeline on virtual time: {cfg.cluster.num_devices} devices, "
        f"{algo.samples_per_iteration} sequences/iteration, {args.iterations} iterations"
    )
    header = ("mode", "mean iter s", "tokens/s", "migrations", "decide p99 ms")
    print(f"{header[0]:<22} {header[1]:>11} {header[2]:>10} {header[3]:>10} {header[4]:>14}")
    for mode in MODES:
        mode_cfg = apply_overrides(cfg, [f"scheduler.mode={mode}"])
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            result = runner.run(run_with_fake_world(mode_cfg, world, profile=profile))
        total = sum(result.iteration_times_s)
        decisions = sorted(result.stats.decision_s) or [0.0]
        p99 = decisions[min(len(decisions) - 1, int(0.99 * len(decisions)))] * 1e3
        print(
            f"{mode:<22} {total / len(result.iteration_times_s):>11.1f} "
            f"{result.tokens_generated / total:>10.0f} {len(result.migrations):>10} {p99:>14.2f}"
        )
        if args.verbose:
            for time_s, devices in result.allocation:
                print(f"    t={time_s:8.1f}s  {devices}")
    return 0


def _sim(args: argparse.Namespace) -> int:
    from dynarl.core.virtual_time import VirtualTimeLoop
    from dynarl.obs.plot import plot_timeline
    from dynarl.obs.timeline import read_timeline, write_timeline
    from dynarl.sim.config import SimulatedRun, simulated_run
    from dynarl.sim.cpu_profile import cpu_profile
    from dynarl.sim.run import simulate

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
    algo = cfg.algorithm
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
        f"{model}, {algo.samples_per_iteration} sequences/iteration, "
        f"{cfg.run.num_iterations} iterations ({sim.warmup_iterations} warm-up)"
    )
    print(
        f"{'mode':<22} {'throughput':>14} {'mean iter s':>11} {'bound s':>8} "
        f"{'above bound':>11} {'migrations':>10} {'crit. path s':>12}"
    )
    recorders = []
    results = []
    with (run_dir / "metrics.jsonl").open("wb") as metrics:
        for mode in modes:
            mode_name, _, extra = mode.partition("+")
            mode_run = simulated_run(sim_run, [f"scheduler.mode={mode_name}"])
            if extra:
                mode_run = simulated_run(mode_run, [f"sim.request_order={extra}"])
            with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
                result, recorder = runner.run(simulate(mode_run, name=mode))
            recorders.append(recorder)
            results.append(result)
            metrics.write(msgspec.json.encode({"run": mode, "result": result}) + b"\n")
            print(
                f"{mode:<22} {result.throughput:>10.1f} {result.unit.split('/')[0][:3]}/s "
                f"{result.mean_iteration_s:>11.1f} {result.bound_s:>8.1f} "
                f"{result.bound_gap:>10.0%} {result.num_migrations:>10} "
                f"{result.critical_path_s:>12.1f}"
            )
            busy = ", ".join(
                f"{c} {t.busy:.0f}/{t.held:.0f}" for c, t in result.devices.items() if t.held
            )
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
            if algo.partial_rollouts:
                print(f"{'':<22} {_staleness(result, sim.warmup_iterations)}")
    _print_bound(results)
    write_timeline(run_dir / "timeline.jsonl", recorders)
    title = f"{sim.workload} {model} on {cfg.cluster.num_devices} x {device}"
    lines = read_timeline(run_dir / "timeline.jsonl")
    plot_timeline(lines, run_dir / "timeline.png", title=title)
    pictures = ["timeline.png"]
    if len(modes) > 1:  # and one picture per mode, on its own time axis
        for mode in modes:
            name = f"timeline-{mode.replace('+', '-')}.png"
            mine = [line for line in lines if line.run == mode]
            plot_timeline(mine, run_dir / name, title=f"{mode}: {title}")
            pictures.append(name)
    print(f"wrote {run_dir}/: config.yaml, metrics.jsonl, timeline.jsonl, {', '.join(pictures)}")
    return 0


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


def _profile(args: argparse.Namespace) -> int:
    from dynarl.cli_profile import profile_command

    return profile_command(args)


def _plot(args: argparse.Namespace) -> int:
    from dynarl.obs.plot import plot_timeline
    from dynarl.obs.timeline import read_timeline

    run_dir = Path(args.run_dir)
    source = run_dir / "timeline.jsonl"
    if not source.exists():
        raise ConfigError(
            f"{source} does not exist: pass a run directory `dynarl run` or `dynarl sim` wrote"
        )
    plot_timeline(read_timeline(source), run_dir / "timeline.png", title=str(run_dir))
    print(f"wrote {run_dir / 'timeline.png'}")
    return 0


# ---------------------------------------------------------------- dynarl run


def _run(args: argparse.Namespace) -> int:
    """``dynarl run``: a real run of the config (or ``--resume`` of a run directory),
    with a progress display; Ctrl-C as :mod:`dynarl.cli_run` says."""
    from dynarl.api.facade import DynaRL
    from dynarl.cli_run import resume_run, run_command

    if args.checkpoint is not None and args.resume is None:
        raise ConfigError("--checkpoint picks a checkpoint of --resume RUN_DIR; pass both")
    if args.resume is not None:
        rl = resume_run(args)
    else:
        rl = DynaRL(resolve_config(args.config, args.set), run_dir=args.out)
    return run_command(args, rl)


def _config(args: argparse.Namespace) -> int:
    from dynarl.sim.config import SimulatedRun, simulated_run

    base = resolve_source(args.config)
    resolved: msgspec.Struct = (
        simulated_run(base, args.set)
        if isinstance(base, SimulatedRun)
        else resolve_config(args.config, args.set)
    )
    print(yaml.safe_dump(msgspec.to_builtins(resolved), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dynarl`` command."""
    parser = argparse.ArgumentParser(prog="dynarl", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO shows plans)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", nargs="?", help="recipe name or config file (default: embedded)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. scheduler.u_low=0.3",
        )

    demo = sub.add_parser("demo", help="run every scheduling mode on the fake pipeline")
    common(demo)
    demo.add_argument("--iterations", type=int, default=3)
    demo.add_argument("-v", "--verbose", action="store_true", help="print allocation changes")
    demo.set_defaults(func=_demo)
    sim = sub.add_parser("sim", help="simulate a job on a modelled cluster; write a run directory")
    common(sim)
    sim.add_argument(
        "--modes",
        help="comma-separated modes (default: scheduler.mode); +priority: "
        "with priority request order, e.g. dynamic+priority",
    )
    sim.add_argument(
        "--compare", action="store_true", help="every mode of the reference comparison"
    )
    sim.add_argument(
        "--workload",
        metavar="FILE",
        help="replay a trace (a run directory's trace.jsonl, or one written by hand); "
        "sets sim.trace and the batch shape from it",
    )
    sim.add_argument(
        "--profile",
        metavar="FILE",
        help="simulate the device `dynarl profile` measured in FILE (sets sim.gpu=FILE)",
    )
    sim.add_argument("--out", help="run directory (default: run.run_dir)")
    sim.set_defaults(func=_sim)
    profile = sub.add_parser(
        "profile", help="measure this machine for the simulator; write a profile file"
    )
    common(profile)
    profile.add_argument("--out", default="profile.json", help="profile file to write")
    profile.add_argument("--repeat", type=int, default=3, help="rounds (medians are kept)")
    profile.add_argument("--threads", type=int, default=1, help="torch threads per slot")
    profile.add_argument("--name", default="", help="the profile's name (default: host)")
    profile.add_argument(
        "--host-slots",
        type=int,
        help="measure how up to N slots busy at once on this host slow each other down "
        "(default: cluster.num_devices; 0: do not, the simulated slots are independent)",
    )
    profile.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        help="profile for a real run: its config, and its controller process's CPU per "
        "response and per token fitted from its metrics.jsonl (the host's other tenant)",
    )
    profile.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help="with --from-run: its first N iterations are left out of the fit (default 1)",
    )
    profile.set_defaults(func=_profile)
    plot = sub.add_parser("plot", help="redraw a run directory's timeline.png")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)
    run = sub.add_parser("run", help="train: a real run of a recipe or config file")
    common(run)
    run.add_argument("--out", help="run directory (default: run.run_dir)")
    run.add_argument(
        "--quiet",
        action="store_true",
        help="one plain line per iteration instead of the live display (the default "
        "when stdout is not a terminal)",
    )
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last checkpoint with the config saved there "
        "(--set still applies, e.g. run.num_iterations=40)",
    )
    run.add_argument(
        "--checkpoint",
        type=int,
        metavar="N",
        help="with --resume: continue from the checkpoint after N iterations instead of "
        "the last one",
    )
    run.set_defaults(func=_run)
    config = sub.add_parser("config", help="print the resolved configuration")
    common(config)
    config.set_defaults(func=_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynarl`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except DynaRLError as exc:
        print(f"dynarl: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # a task group's: say its first error in words
        error = _first_dynarl_error(group)
        if error is None:
            raise
        print(f"dynarl: error: {error}", file=sys.stderr)
        return 2
    return code


def _first_dynarl_error(error: BaseException) -> DynaRLError | None:
    if isinstance(error, DynaRLError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _first_dynarl_error(inner)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
