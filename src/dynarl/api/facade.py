"""The :class:`DynaRL` facade: one object that wires a configuration into a real run.

::

    async with DynaRL(cfg) as rl:
        await rl.run()                   # or: async for stats in rl.iterations(): ...

Entering it checks that the backends the config names can run here, binds the data
router, launches the workers (device slots and trainer processes), builds the
hypergraph and starts the controller and the pipeline driver
(:class:`~dynarl.rl.pipeline.Pipeline`); leaving it stops them in reverse order, also
on error or cancellation, and no worker process outlives it. The run's own tasks live
in a host task the run owns (:mod:`dynarl.api.host`), so a run opened in one notebook
cell can be used and closed in later ones. It runs on whatever asyncio loop is running:
no ``asyncio.run``, signal handlers, ``atexit`` or globals. Backends are imported
lazily, when a run starts.
"""

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import anyio
import msgspec

from dynarl.api.checkpoint import (
    Checkpoint,
    RunState,
    check_carried,
    checkpoints,
    fingerprint,
    trainer_path,
    write_state,
)
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import dump_config
from dynarl.api.host import RunFailedError, RunHost
from dynarl.api.run_dir import RunDirectory
from dynarl.api.run_errors import IterationInterruptedError, TrainerRankLostError
from dynarl.api.run_timeline import RunTimeline
from dynarl.api.stall import StallWatch
from dynarl.core.errors import ConfigError, DynaRLError
from dynarl.obs.metrics import DeviceMeter, FlatValue, IterationStats, MetricsWriter, flat_record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from dynarl.api.world import RealWorld
    from dynarl.control.controller import Controller
    from dynarl.envs.environment import EnvironmentSpec
    from dynarl.envs.prompts import PromptSampler
    from dynarl.rl.pipeline import Pipeline
from dynarl.rl.progress import Progress

logger = logging.getLogger(__name__)


class DynaRL:
    """A run of ``cfg``: ``async with`` it, then :meth:`run` or :meth:`iterations`.

    Args:
        cfg: the run's configuration.
        run_dir: where the run directory goes (default: ``cfg.run.run_dir``).
        on_progress: sees the running iteration's progress (rollout responses done,
            optimizer steps taken), for a progress display.
        resume_from: a run directory to continue from its last checkpoint (the run
            goes on writing there); ``cfg`` should be the configuration saved there,
            see :meth:`resume`.
        resume_at: with ``resume_from``, continue from the checkpoint after this many
            iterations instead of the last one (e.g. when the last one is damaged).
        environment: the multi-turn environment whose episodes the run trains on
            (:mod:`dynarl.envs`); default: the built-in one ``cfg.env.name`` names, or
            the single-turn bracket task.
    """

    def __init__(
        self,
        cfg: DynaRLConfig,
        *,
        run_dir: str | Path | None = None,
        on_progress: "Callable[[Progress], None] | None" = None,
        resume_from: str | Path | None = None,
        environment: "EnvironmentSpec | None" = None,
        resume_at: int | None = None,
    ) -> None:
        if resume_at is not None and resume_from is None:
            raise ConfigError("resume_at picks a checkpoint of resume_from; pass both")
        if resume_from is not None:
            if run_dir is not None and Path(run_dir).resolve() != Path(resume_from).resolve():
                raise ConfigError(
                    f"a resumed run continues in its own directory {resume_from}, not in "
                    f"{run_dir}; drop run_dir (or copy the run directory first)"
                )
            run_dir = resume_from
        self.cfg = cfg
        self.environment = environment
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run.run_dir)
        self.on_progress = on_progress
        timeout = cfg.run.stall_timeout_s
        self._stall = StallWatch(timeout) if timeout else None
        self.resume_from = None if resume_from is None else Path(resume_from)
        self.resume_at = resume_at
        self._files = RunDirectory(self.run_dir)
        self._timeline = RunTimeline()
        self._saved_at: int | None = None
        self.history: list[IterationStats] = []
        """Stats of every finished iteration, in order."""
        self.controller: Controller | None = None
        """The control loop (while the run is open)."""
        self._host: RunHost | None = None
        self._pipeline: Pipeline | None = None
        self._world: RealWorld | None = None
        self._sampler: PromptSampler | None = None
        self._meter: DeviceMeter | None = None
        self._metrics: MetricsWriter | None = None
        self._step_scope: anyio.CancelScope | None = None
        self._stop_requested = False
        self._interrupted = False  # a step was stopped before it finished
        self._consistent = True  # the trainer holds the state after len(history) iterations

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        overrides: Iterable[str] = (),
        *,
        on_progress: "Callable[[Progress], None] | None" = None,
        checkpoint: int | None = None,
        environment: "EnvironmentSpec | None" = None,
    ) -> "DynaRL":
        """A run that continues ``run_dir`` from its last checkpoint (or the one after
        ``checkpoint`` iterations), with the config saved there plus ``overrides``
        (e.g. ``["run.num_iterations=40"]``): the same prompts, trainer state and
        weight version, so it ends as an uninterrupted run would; ``metrics.jsonl`` and
        ``timeline.jsonl`` go on where they stopped. The checkpoint is checked whole
        when the run opens, before anything starts or is written. ``environment``: the
        run's multi-turn environment, when it was given in code (a config names only
        the built-in ones)."""
        cfg = RunDirectory(run_dir).load_config(overrides)
        return cls(
            cfg,
            on_progress=on_progress,
            resume_from=run_dir,
            resume_at=checkpoint,
            environment=environment,
        )

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        if self._host is not None:
            raise DynaRLError("this DynaRL run is already open; use a new DynaRL object")
        self._host = RunHost()
        try:
            await self._host.start(self._open)
        except BaseException:
            self._host = None
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        host, self._host = self._host, None
        if host is None:
            return
        try:
            await host.stop()
        except RunFailedError:
            if exc is None:
                raise  # else the caller's own error (the run's failure, often) goes on

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        # Checked first: a backend that cannot run here, or a directory with nothing to
        # resume, fails before anything loads.
        from dynarl.api.assembly import (
            check_backends,
            check_predictor_profile,
            environment_of,
            warm_started,
        )

        check_backends(self.cfg)
        check_predictor_profile(self.cfg)
        environment = environment_of(self.cfg, self.environment)
        if self.resume_from is not None:  # before the directory is locked or written
            check_carried(self._files.checkpoint(self.resume_at), self.cfg.algorithm)
        # Held until the run closes: a second run cannot write into this directory.
        stack.enter_context(self._files.lock())
        resumed = (
            None if self.resume_from is None else self._files.resume_point(self.cfg, self.resume_at)
        )
        from dynarl.api.assembly import assemble

        cfg = self.cfg
        files = self._files
        if resumed is not None:
            self.history = list(resumed.history)
            self._timeline.before = resumed.timeline
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, files.config_path)
        self._metrics = stack.enter_context(
            MetricsWriter(files.metrics_path, append=resumed is not None)
        )
        run = await assemble(
            await warm_started(cfg, environment, self.run_dir),
            stack,
            environment=environment,
            run_dir=self.run_dir,
            resumed=None if resumed is None else resumed.checkpoint,
            on_progress=self._progressed,
            before_controller=functools.partial(stack.callback, self._write_timeline_at_exit),
        )
        self.controller, self._world, self._pipeline = run.controller, run.world, run.pipeline
        if self._stall is not None:
            self.controller.listeners.append(self._stall.on_event)
        run.world.on_failure = self._world_failed
        self._meter, self._sampler = run.meter, run.sampler
        self._timeline.open(run.recorder, run.controller.clock)
        logger.info(
            "run %s: %s, run directory %s",
            "open" if resumed is None else f"resumed after iteration {len(self.history) - 1}",
            cfg.scheduler.mode,
            self.run_dir,
        )

    # ------------------------------------------------------------------ running

    async def iterations(self, num_iterations: int | None = None) -> AsyncIterator[IterationStats]:
        """Run iterations one at a time, yielding each one's stats as it finishes
        (default: ``cfg.run.num_iterations`` in all, counting those already run)."""
        if self._host is None or self._pipeline is None:
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        total = self.cfg.run.num_iterations if num_iterations is None else num_iterations
        while len(self.history) < total and not self._stop_requested:
            try:
                stats = await self.step()
            except IterationInterruptedError:
                return
            yield stats

    async def step(self) -> IterationStats:
        """Run one iteration and return its stats (also written to ``metrics.jsonl``)."""
        if (
            self._host is None
            or self._pipeline is None
            or self._meter is None
            or self._metrics is None
            or self.controller is None
        ):
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        if self._interrupted:
            raise DynaRLError(
                "an iteration of this run was interrupted and left the pipeline "
                "mid-flight; save_checkpoint() if `checkpointable`, close the run and "
                "resume it (DynaRL.resume)"
            )
        index = len(self.history)
        self._meter.take(self.controller.clock.now())  # count this iteration only
        sampler = self._sampler.state_dict() if self._sampler is not None else None
        scope = self._step_scope = anyio.CancelScope()
        cpu_s = time.process_time()  # every thread of this process; workers are others
        try:
            with self._host.call(), scope:
                stats = await self._watched(self._pipeline.run(index), scope)
        except BaseException as error:
            self._note_interrupted(sampler)
            from dynarl.api.executor import trainer_rank_loss

            failure = trainer_rank_loss(error)
            if failure is None:
                raise
            raise self._rank_lost(index, failure) from error
        finally:
            self._step_scope = None
        if scope.cancelled_caught and self._world is not None and self._world.failure:
            self._note_interrupted(sampler)
            raise self._rank_lost(index, self._world.failure)
        if scope.cancelled_caught and self._stall is not None and self._stall.stalled_s:
            self._note_interrupted(sampler)
            assert self._world is not None
            graph, router = self.controller.graph, self._world.router
            raise self._stall.error(index, self._resume_hint(), graph, router)
        if scope.cancelled_caught:
            self._note_interrupted(sampler)
            raise IterationInterruptedError(
                f"iteration {index} was stopped before it finished (request_stop)"
            )
        reading = self._meter.take(self.controller.clock.now())
        stats = msgspec.structs.replace(
            stats,
            device_s=reading.device_s,
            allocation=self._meter.allocation(),
            migrations=reading.migrations,
            engine_steps=reading.engine_steps,
            restarts={} if self._world is None else self._world.reboots.budget.taken(),
            controller_cpu_s=time.process_time() - cpu_s,
        )
        self.history.append(stats)
        self._metrics.write(stats)
        every = self.cfg.run.checkpoint_every
        if every and (index + 1) % every == 0:
            await self.save_checkpoint()
        return stats

    async def _watched(
        self, iteration: Coroutine[Any, Any, IterationStats], scope: anyio.CancelScope
    ) -> IterationStats:
        return await (iteration if self._stall is None else self._stall.watched(iteration, scope))

    def _progressed(self, progress: "Progress") -> None:
        if self._stall is not None:
            self._stall.progress()
        if self.on_progress is not None:
            self.on_progress(progress)

    def _resume_hint(self) -> str:
        """Where ``dynarl run --resume`` would continue this run, if anywhere."""
        last = self.last_checkpoint()
        if last is None:
            return "no checkpoint exists yet: start it again"
        return (
            f"continue from its last checkpoint (after {last.state.num_iterations} "
            f"iterations) with `dynarl run --resume {self.run_dir}`"
        )

    def _rank_lost(self, index: int, failure: BaseException) -> "TrainerRankLostError":
        error = TrainerRankLostError(
            f"iteration {index} failed: {failure}. The trainer could not rebuild itself "
            f"from the surviving workers; the run stops: {self._resume_hint()}"
        )
        error.__cause__ = failure
        return error

    def _world_failed(self, error: BaseException) -> None:
        """The world cannot go on: stop the running iteration (it raises why)."""
        if self._step_scope is not None:
            self._step_scope.cancel()

    def request_stop(self, *, now: bool = False) -> bool:
        """Stop the run at the earliest point that loses no finished iteration:
        :meth:`iterations` ends after the running iteration, or at once when the
        trainer has not stepped in it yet (the iteration is dropped: a resumed run
        runs it again). With ``now`` the running iteration stops at once regardless
        (then the run is :attr:`checkpointable` only if its trainer had not stepped).
        Safe to call from a signal handler on the run's loop. Returns whether the
        running iteration (if any) is being stopped now."""
        self._stop_requested = True
        scope = self._step_scope
        if scope is None:
            return False
        world = self._world
        if now or world is None or not world.weights.trainer_ahead:
            scope.cancel()
            return True
        return False

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called."""
        return self._stop_requested

    @property
    def checkpointable(self) -> bool:
        """Whether :meth:`save_checkpoint` can save the run now: the trainer holds the
        state after the finished iterations (false after an iteration was stopped once
        its trainer had stepped)."""
        return self._consistent

    def last_checkpoint(self) -> Checkpoint | None:
        """The newest complete checkpoint in the run directory, if any."""
        try:
            found = checkpoints(self.run_dir)
        except DynaRLError:
            return None
        return found[-1] if found else None

    def _note_interrupted(self, sampler: dict[str, int] | None) -> None:
        """A step ended before its iteration finished: the prompts it drew go back
        (a resume draws them again), and whether the trainer stepped decides whether
        the run can still be checkpointed."""
        self._interrupted = True
        if sampler is not None and self._sampler is not None:
            self._sampler.load_state_dict(sampler)
        if self._world is not None and self._world.weights.trainer_ahead:
            self._consistent = False

    async def run(self, num_iterations: int | None = None) -> list[IterationStats]:
        """Run to ``num_iterations`` iterations (default ``cfg.run.num_iterations``),
        save a final checkpoint, and return every iteration's stats."""
        async for _ in self.iterations(num_iterations):
            pass
        await self.save_checkpoint()
        return list(self.history)

    async def save_checkpoint(self) -> Path:
        """Write a checkpoint of the run so far: the actor's model and optimizer state
        in ``checkpoints/iter_NNNN.pt``, what the driver needs to resume beside it
        (``iter_NNNN.json``, with the requests partial rollouts carry over), the
        timeline so far (``timeline.jsonl``, ``timeline.png``) and what the scheduler's
        predictor learnt (``predictor.json``, which a resumed or later run starts from:
        ``scheduler.predictor_profile``). Returns the trainer state's path."""
        if (
            self._host is None
            or self._world is None
            or self._world.trainer is None
            or self._sampler is None
            or self._pipeline is None
            or self._timeline.recorder is None
        ):
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        if not self._consistent:
            last = self.last_checkpoint()
            where = (
                f"the last checkpoint is {last.trainer_path}"
                if last is not None
                else "no checkpoint exists"
            )
            raise DynaRLError(
                f"iteration {len(self.history)} was interrupted after its trainer stepped: "
                f"the trainer no longer holds a finished iteration's state; {where}"
            )
        done = len(self.history)
        path = trainer_path(self.run_dir, done)
        if self._saved_at == done:
            return path  # nothing happened since (checkpoint_every at the last iteration)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Held between optimizer steps: no resize of the trainer moves its state meanwhile.
        trainer = self._world.trainer
        with self._host.call():
            async with trainer.between_steps():
                await trainer.save_checkpoint(str(path))
        lines = self._timeline.lines()
        size, sha256 = await anyio.to_thread.run_sync(fingerprint, path)
        write_state(
            self.run_dir,
            RunState(
                trainer_bytes=size,
                trainer_sha256=sha256,
                num_iterations=done,
                weight_version=self.history[-1].weight_version if self.history else 0,
                seed=self.cfg.run.seed,
                sampler=self._sampler.state_dict(),
                timeline_s=self._timeline.elapsed_s(),
                carried=self._pipeline.carried,
            ),
        )
        self._saved_at = done
        await anyio.to_thread.run_sync(
            functools.partial(self._files.write_timeline, lines, title=self._title())
        )
        if self.controller is not None and self.controller.predictor is not None:
            profile = self.controller.predictor.to_profile()
            await anyio.to_thread.run_sync(self._files.write_predictor, profile)
        return path

    # ------------------------------------------------------------------ notebooks

    def allocation(self) -> dict[str, int]:
        """Devices each component holds now (empty before the run opens)."""
        return {} if self._meter is None else self._meter.allocation()

    def worker_hosts(self) -> dict[str, list[str]]:
        """The workers on each host (a node's address; ``127.0.0.1`` for local
        processes), by name: where the run's processes are (empty before it opens)."""
        hosts: dict[str, list[str]] = {}
        if self._world is not None:
            for where in self._world.launcher.locations.values():
                hosts.setdefault(where.host, []).append(where.name)
        return hosts

    def metrics_records(self) -> list[dict[str, FlatValue]]:
        """Every finished iteration's stats as a flat dict (``stage_s.rollout``,
        ``device_s.actor``, ...): ``pandas.DataFrame(rl.metrics_records())``."""
        return [flat_record(s) for s in self.history]

    def timeline_figure(self) -> "Figure":
        """The device-allocation timeline so far as a matplotlib ``Figure`` (needs
        matplotlib, in the ``cli`` extra); ``display(fig)`` shows it in a notebook."""
        from dynarl.obs.plot import timeline_figure

        return timeline_figure(self._timeline.lines(), title=self._title())

    # ------------------------------------------------------------------ timeline

    def _title(self) -> str:
        cfg = self.cfg
        return f"{self.run_dir}: {cfg.scheduler.mode}, {cfg.cluster.num_devices} devices"

    def _write_timeline_at_exit(self) -> None:
        """The timeline as the run ends; a failure to write it does not hide the run's
        own outcome."""
        if self._timeline.recorder is None:
            return
        self._timeline.close()
        try:
            self._files.write_timeline(self._timeline.lines(), title=self._title())
        except Exception:
            logger.exception("could not write the timeline to %s", self.run_dir)
