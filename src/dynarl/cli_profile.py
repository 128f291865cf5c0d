"""``dynarl profile``: measure this machine for the simulator and write a profile file
(:mod:`dynarl.sim.profile_file`); with ``--from-run RUN_DIR``, for that real run: its
config, and its controller process's CPU fitted from its records
(:mod:`dynarl.sim.controller_cpu`) as the host's other tenant."""

import argparse

import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.api.run_dir import RunDirectory
from dynarl.cli_sources import resolve_config
from dynarl.control.predictor import usable_cores
from dynarl.core.errors import ConfigError
from dynarl.sim.controller_cpu import ControllerCost, controller_cost_of_run
from dynarl.sim.profile_file import measured_profile, read_profile, write_profile
from dynarl.workers.backends import reference_profiler


def profile_command(args: argparse.Namespace) -> int:
    """``dynarl profile``: measure this machine (for ``--from-run``'s run, with its
    controller's CPU) and write the profile file; prints what it measured."""
    if args.from_run is None:
        if args.warmup is not None:
            raise ConfigError("--warmup leaves iterations of --from-run RUN_DIR out; pass both")
        cfg = resolve_config(args.config, args.set)
        controller = None
    else:
        cfg, controller = profiled_run(args)
    if cfg.cluster.accelerator != "cpu":
        raise ConfigError(
            f"dynarl profile measures the reference workers on this machine's CPU, not "
            f"cluster.accelerator={cfg.cluster.accelerator}: set cluster.accelerator=cpu",
            field="cluster.accelerator",
        )
    if args.from_run is not None and controller is None:
        print(
            f"{args.from_run}'s slots do not share the controller's host (GPUs, other "
            "backends or Ray): its controller's CPU slows none of them, so the profile "
            "carries no controller terms"
        )
    print(
        f"profiling the reference workers on this machine: {args.threads} thread(s) per "
        f"slot, model {cfg.model.arch} {cfg.model.num_layers}x{cfg.model.hidden_size} "
        f"{cfg.model.dtype}, {args.repeat} round(s)"
    )
    measured = reference_profiler().measure_machine(
        cfg, repeat=args.repeat, threads=args.threads, host_slots=args.host_slots
    )
    profile = measured_profile(
        measured.costs,
        model=cfg.model,
        threads=measured.threads,
        host=measured.host,
        name=args.name or f"{measured.name}-{measured.threads}t",
        host_slowdown=measured.host_slowdown,
        host_cores=usable_cores(),
        controller=controller,
    )
    write_profile(args.out, profile)
    read_profile(args.out)  # what `dynarl sim --profile` will read
    device = msgspec.structs.asdict(profile.device)
    for field in profile.measured:
        value = device[field]
        if field == "controller_cpu_per_token_s":
            print(f"  {field:<28} {value * 1e6:10.4f} us")
        elif field == "transfer_bytes_per_s":
            print(f"  {field:<28} {value / 1e9:10.3f} GB/s")
        elif field.endswith("_s"):
            print(f"  {field:<28} {value * 1e3:10.4f} ms")
        elif field == "host_cores":
            print(f"  {field:<28} {value:10d}")
        elif field == "host_slowdown":
            curve = ", ".join(f"{n} busy x{f:.2f}" for n, f in enumerate(value, start=1))
            print(f"  {field:<28} {curve}")
    if controller is not None:
        print(
            f"  controller CPU fitted over {controller.num_iterations} iterations of "
            f"{args.from_run}: {controller.mean_cpu_s:.3f} s an iteration of "
            f"{controller.mean_responses:.0f} responses and {controller.mean_tokens:.0f} "
            f"tokens (relative RMS residual {controller.rms_fit:.2f})"
        )
    print(f"wrote {args.out}: simulate with `dynarl sim --profile {args.out}`")
    return 0


def profiled_run(args: argparse.Namespace) -> tuple[DynaRLConfig, ControllerCost | None]:
    """``dynarl profile --from-run``: the run's own config (with ``--set``) and its
    controller's CPU fitted from its records (``None``: its slots do not share the
    host, so the controller slows none of them); refused before anything is measured."""
    if args.config is not None:
        raise ConfigError(
            f"--from-run profiles the run's own config ({args.from_run}/config.yaml); "
            f"drop {args.config!r} (--set still applies)"
        )
    controller = controller_cost_of_run(
        args.from_run, warmup=1 if args.warmup is None else args.warmup
    )
    cfg = RunDirectory(args.from_run).load_config(args.set)
    slots = cfg.cluster.num_devices if args.host_slots is None else args.host_slots
    if controller is not None and slots < 2:
        raise ConfigError(
            f"--from-run writes the controller's CPU, which counts only on the host-sharing "
            f"curve, and --host-slots {slots} measures none: pass --host-slots 2 or more"
        )
    return cfg, controller
