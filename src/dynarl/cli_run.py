"""``dynarl run``: a real run (or ``--resume`` of a run directory) with a progress
display, and what Ctrl-C does to it (part of the CLI: it prints, and owns SIGINT).

Ctrl-C (SIGINT, which a terminal sends to the whole process group; the workers ignore
it and are stopped by the controller) asks the run to stop at the earliest point that
loses no finished iteration (:meth:`~dynarl.api.facade.DynaRL.request_stop`): at once
when the running iteration's trainer has not stepped yet (the iteration is dropped and
a resume runs it again), else after that iteration. What the resume needs is then
saved, a checkpoint of the finished iterations, and one line says how to continue, or
plainly that nothing can be resumed. A second Ctrl-C stops the running iteration at
once; a third leaves the process at once (the workers notice their parent is gone and
exit).
"""

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import anyio

from dynarl.api.facade import DynaRL
from dynarl.api.run_dir import RunDirectory
from dynarl.cli_display import RunDisplay
from dynarl.core.errors import ConfigError

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells expect."""


def run_command(args: argparse.Namespace, rl: DynaRL) -> int:
    """Run ``rl`` to its configured iterations with a display; Ctrl-C as the module
    docstring says. Returns the exit status."""
    cfg = rl.cfg
    display = RunDisplay(
        live=not args.quiet and sys.stdout.isatty(), num_iterations=cfg.run.num_iterations
    )
    rl.on_progress = display.progress
    display.allocation = rl.allocation
    interrupts = _Interrupts(rl, display)
    outcome: list[str] = []

    async def main() -> None:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, interrupts.on_sigint)
        interrupts.whole = whole = anyio.CancelScope()
        try:
            with display, whole:
                async with rl:
                    interrupts.opened = True
                    done = len(rl.history)
                    display.print(
                        f"dynarl run: {cfg.scheduler.mode}, {cfg.cluster.num_devices} devices, "
                        f"run directory {rl.run_dir}"
                        + (f", resumed after {done} iterations" if args.resume else "")
                        + f" (started in {time.perf_counter() - started:.1f} s)"
                    )
                    for host, names in rl.worker_hosts().items():
                        display.print(f"  workers on {host}: {', '.join(names)}")
                    async for stats in rl.iterations():
                        display.iteration(stats)
                    outcome.append(await _finish(rl, display, started, interrupts))
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        if whole.cancelled_caught and not outcome:
            outcome.append(_interrupted_line(rl, saved=None, starting=not interrupts.opened))

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # before the handler was installed, or after it was removed
        print(_interrupted_line(rl, saved=None, starting=True), file=sys.stderr)
        return EXIT_INTERRUPTED
    line = outcome[0] if outcome else "stopped"
    if rl.stop_requested:
        print(line, file=sys.stderr)
        return EXIT_INTERRUPTED
    print(line)
    return 0


async def _finish(
    rl: DynaRL, display: RunDisplay, started: float, interrupts: "_Interrupts"
) -> str:
    """Save what a resume needs and say what happened, in one line."""
    if not rl.stop_requested:
        display.set_status("saving the final checkpoint and timeline")
        path = await rl.save_checkpoint()
        return (
            f"done in {time.perf_counter() - started:.1f} s; checkpoint {path}; "
            f"timeline {rl.run_dir / 'timeline.png'}"
        )
    saved = None
    if rl.checkpointable and rl.history:
        display.set_status("interrupted: saving a checkpoint of the finished iterations")
        interrupts.saving = True
        saved = await rl.save_checkpoint()
    return _interrupted_line(rl, saved=saved, starting=False)


def _interrupted_line(rl: DynaRL, *, saved: Path | None, starting: bool) -> str:
    """The one line Ctrl-C leaves: what was saved and the command that continues."""
    resume = f"`dynarl run --resume {rl.run_dir}`"
    restart = "run the same `dynarl run` command again"
    if starting and not rl.history:
        return f"interrupted while starting; nothing ran, nothing to resume: {restart}"
    done = len(rl.history)
    if saved is not None:
        return (
            f"interrupted after {done} finished iterations; saved checkpoint {saved}; "
            f"continue with {resume}"
        )
    last = rl.last_checkpoint()
    if last is None:
        if rl.resume_from is None and done == 0:
            return (
                "interrupted during iteration 0: no iteration finished, nothing to resume: "
                f"{restart}"
            )
        return f"interrupted after {done} finished iterations, but no checkpoint exists: {restart}"
    n = last.state.num_iterations
    lost = f" (iterations {n}..{done - 1} will run again)" if done > n else ""
    return f"interrupted; the last checkpoint is after {n} iterations{lost}: continue with {resume}"


def quiet_shutdown() -> None:
    """After Ctrl-C the user asked for the run to end: workers cut off on the way
    out (connection lost, terminated) are expected, not news; unless a more verbose
    ``--log-level`` was asked for, only errors are logged from now on."""
    root = logging.getLogger("dynarl")
    if logging.getLogger().getEffectiveLevel() >= logging.WARNING:
        root.setLevel(logging.ERROR)


class _Interrupts:
    """What each Ctrl-C does (see the module docstring)."""

    def __init__(self, rl: DynaRL, display: RunDisplay) -> None:
        self.rl = rl
        self.display = display
        self.whole: anyio.CancelScope | None = None  # made on the loop (main)
        self.opened = False
        self.saving = False
        self.count = 0

    def on_sigint(self) -> None:
        self.count += 1
        quiet_shutdown()
        if self.count >= 3:
            print("interrupted three times: leaving now", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        if not self.opened:  # still starting: nothing to save, stop starting
            self.rl.request_stop(now=True)
            if self.whole is not None:
                self.whole.cancel()
            return
        if self.count == 1:
            if self.saving or not self.rl.request_stop():
                self.display.set_status(
                    "stopping after this iteration (its optimizer steps have begun); "
                    "Ctrl-C again to stop now"
                )
            else:
                self.display.set_status("stopping: saving the finished iterations")
        else:
            self.rl.request_stop(now=True)
            if self.saving and self.whole is not None:
                self.whole.cancel()


def resume_run(args: argparse.Namespace) -> DynaRL:
    """The run ``--resume RUN_DIR`` continues, checked before anything starts."""
    if args.config is not None:
        raise ConfigError(
            f"--resume {args.resume} continues with the config saved there; drop "
            f"{args.config!r} (change values with --set)"
        )
    if args.out is not None:
        raise ConfigError(f"--resume {args.resume} goes on writing there; drop --out")
    rl = DynaRL.resume(args.resume, args.set, checkpoint=args.checkpoint)
    done = RunDirectory(args.resume).checkpoint(args.checkpoint).state.num_iterations
    if done >= rl.cfg.run.num_iterations:
        raise ConfigError(
            f"{args.resume} already ran {done} iterations (run.num_iterations="
            f"{rl.cfg.run.num_iterations}); continue it with --set run.num_iterations=N "
            f"for some N > {done}",
            field="run.num_iterations",
        )
    return rl
