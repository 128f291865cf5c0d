"""The ``dynarl`` command line.

``dynarl demo`` runs the real controller under every scheduling mode against the
in-process fake pipeline on virtual time and prints what each mode did;
``dynarl config`` prints a resolved configuration. The CLI is the application: it may
print and start event loops; the library never does.
"""

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import yaml

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, load_config
from dynarl.core.errors import ConfigError, DynaRLError

MODES = ("static-colocated", "static-disaggregated", "dynamic")


def resolve_config(source: str | None, overrides: Sequence[str]) -> DynaRLConfig:
    """A config from a recipe name (a function in ``recipes``), a file, or the
    embedded default, with ``overrides`` applied."""
    if source is None:
        base = DynaRLConfig()
    elif Path(source).suffix.lower() in (".yaml", ".yml", ".toml", ".json"):
        return load_config(source, overrides)
    else:
        recipes = importlib.import_module("recipes")
        factory = getattr(recipes, source, None)
        if not callable(factory):
            known = ", ".join(n for n in getattr(recipes, "__all__", ()))
            raise ConfigError(f"no recipe {source!r}; known recipes: {known} (or a config file)")
        base = factory()
    return apply_overrides(base, overrides)


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


def _config(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config, args.set)
    print(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False), end="")
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
    return code


if __name__ == "__main__":
    sys.exit(main())
