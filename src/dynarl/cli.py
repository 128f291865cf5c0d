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
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import yaml

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
    from dynarl.cli_sim import sim_command

    return sim_command(args)


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
    sim.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run every mode at each value of a config key, e.g. rollout.tp=2,4 "
        "(repeat for a grid of keys)",
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
