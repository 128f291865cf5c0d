"""The :class:`DynaRL` facade: one object that wires a configuration into a real run.

::

    async with DynaRL(cfg) as rl:
        await rl.run()                   # or: async for stats in rl.iterations(): ...

Entering it binds the data router, launches the workers (device slots and trainer
processes), builds the hypergraph and starts the controller in the root task group;
leaving it stops them in reverse order, also on error or cancellation, and no worker
process outlives it. It runs on whatever loop is running (a notebook's included): no
``asyncio.run``, signal handlers, ``atexit`` or globals. Torch is imported lazily, when
a run starts.
"""

import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

import anyio
import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import dump_config
from dynarl.api.pipeline import build_hypergraph
from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.clock import LoopClock
from dynarl.core.errors import ConfigError, DynaRLError
from dynarl.obs.metrics import DeviceMeter, IterationStats, MetricsWriter

if TYPE_CHECKING:
    from dynarl.api.iteration import GrpoIteration, Progress
    from dynarl.control.controller import Controller

logger = logging.getLogger(__name__)


REAL_MODES = ("static-disaggregated",)
"""Scheduling modes a run on real workers supports so far."""


class DynaRL:
    """A run of ``cfg``: ``async with`` it, then :meth:`run` or :meth:`iterations`.

    Args:
        cfg: the run's configuration.
        run_dir: where the run directory goes (default: ``cfg.run.run_dir``).
        on_progress: sees the running iteration's progress (rollout responses done,
            optimizer steps taken), for a progress display.
    """

    def __init__(
        self,
        cfg: DynaRLConfig,
        *,
        run_dir: str | Path | None = None,
        on_progress: "Callable[[Progress], None] | None" = None,
    ) -> None:
        if cfg.scheduler.mode not in REAL_MODES:
            # Moving trainer devices (reshard) between real workers is not wired yet:
            # refuse up front rather than let every planned move fail at run time.
            raise ConfigError(
                f"scheduler.mode={cfg.scheduler.mode!r} cannot run on real workers yet "
                f"(moving the trainer's devices is not wired to the worker processes); "
                f"use --set scheduler.mode=static-disaggregated, or `dynarl sim` to see "
                f"what {cfg.scheduler.mode} scheduling buys on a modelled cluster",
                field="scheduler.mode",
            )
        self.cfg = cfg
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run.run_dir)
        self.on_progress = on_progress
        self.history: list[IterationStats] = []
        """Stats of every finished iteration, in order."""
        self.controller: Controller | None = None
        """The control loop (while the run is open)."""
        self._stack: contextlib.AsyncExitStack | None = None
        self._iteration: GrpoIteration | None = None
        self._meter: DeviceMeter | None = None
        self._metrics: MetricsWriter | None = None
        self._forward = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise DynaRLError("this DynaRL run is already open; use a new DynaRL object")
        self._stack = contextlib.AsyncExitStack()
        try:
            await self._open(self._stack)
        except BaseException:
            stack, self._stack = self._stack, None
            await stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._forward = False
        if stack is not None:
            # Not shielded as a whole: a shield entered here would sit inside the task
            # groups being left. The steps that must finish (stopping processes) shield
            # themselves.
            await stack.aclose()

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        # Heavy modules (torch, transformers, zmq) load here, not on `import dynarl`.
        from dynarl.api.executor import WorldExecutor
        from dynarl.api.iteration import GrpoIteration
        from dynarl.api.world import RealWorld
        from dynarl.control.controller import Controller
        from dynarl.control.modes import make_policy
        from dynarl.control.predictor import Predictor
        from dynarl.data import RouterConfig
        from dynarl.data.router import Router
        from dynarl.data.zmq_transport import ZmqTransport
        from dynarl.envs.prompts import prompt_sampler
        from dynarl.envs.synthetic import SyntheticTask
        from dynarl.envs.verifier import AsyncVerifier, MatchVerifier
        from dynarl.workers.torch.model import load_tokenizer

        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")
        self._metrics = stack.enter_context(MetricsWriter(self.run_dir / "metrics.jsonl"))

        ipc_dir = Path(tempfile.mkdtemp(prefix="dynarl-"))
        stack.callback(shutil.rmtree, ipc_dir, ignore_errors=True)
        transport = ZmqTransport.bind(f"ipc://{ipc_dir}/router.sock")
        stack.push_async_callback(transport.aclose)

        clock = LoopClock()
        graph, baseline = build_hypergraph(cfg, now_s=clock.now())
        predictor = Predictor({c: n.spec.scaling for c, n in graph.components.items()})
        self._meter = DeviceMeter(graph, now_s=clock.now())
        # Generous liveness: on a small CPU machine the slots share cores with training.
        router_cfg = RouterConfig(heartbeat_interval_s=0.5, liveness_timeout_s=60.0)
        router = await stack.enter_async_context(
            Router(
                transport, consumers={PROMPTS: [ROLLOUT]}, config=router_cfg, on_event=self._bridge
            )
        )
        world = RealWorld(cfg, graph, router)
        stack.push_async_callback(world.aclose)
        await world.start()

        controller = Controller(
            graph,
            make_policy(cfg.scheduler, predictor, baseline),
            WorldExecutor(world),
            clock=clock,
            predictor=predictor,
            tick_s=cfg.scheduler.tick_s,
            listeners=[self._meter],
        )
        self.controller = controller
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)  # runs first on exit: stop the controller
        send, receive = anyio.create_memory_object_stream[ev.Event](0)
        stack.callback(send.close)
        await tg.start(controller.run, receive)
        self._forward = True

        seed = cfg.run.seed
        self._iteration = GrpoIteration(
            cfg,
            world,
            graph,
            emit=controller.handle,
            sampler=prompt_sampler(cfg.data, seed=seed, generator=SyntheticTask(seed=seed).prompt),
            verifier=AsyncVerifier(MatchVerifier()),
            tokenizer=load_tokenizer(cfg.model),
            on_progress=self.on_progress,
        )
        logger.info("run open: %s, run directory %s", cfg.scheduler.mode, self.run_dir)

    def _bridge(self, event: ev.Event) -> None:
        """The router's events to the controller, with the downstream ``ItemsEnqueued``
        of a finished rollout item reported before its ``ItemCompleted``."""
        if not self._forward or self.controller is None or self._iteration is None:
            return  # before the controller runs, or while shutting down
        if isinstance(event, ev.ItemCompleted) and event.edge == PROMPTS:
            group = self._iteration.groups.get(event.item)
            if group is not None:
                self.controller.handle(
                    ev.ItemsEnqueued(
                        edge=self._iteration.downstream(), items=(ev.ItemRef(event.item, group),)
                    )
                )
        self.controller.handle(event)

    # ------------------------------------------------------------------ running

    async def iterations(self, num_iterations: int | None = None) -> AsyncIterator[IterationStats]:
        """Run iterations one at a time, yielding each one's stats as it finishes
        (default: ``cfg.run.num_iterations`` in all, counting those already run)."""
        if self._iteration is None or self._stack is None:
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        total = self.cfg.run.num_iterations if num_iterations is None else num_iterations
        while len(self.history) < total:
            stats = await self.step()
            yield stats

    async def step(self) -> IterationStats:
        """Run one iteration and return its stats (also written to ``metrics.jsonl``)."""
        if (
            self._iteration is None
            or self._meter is None
            or self._metrics is None
            or self.controller is None
        ):
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        index = len(self.history)
        self._meter.take(self.controller.clock.now())  # count this iteration only
        stats = await self._iteration.run(index)
        device_s, migrations = self._meter.take(self.controller.clock.now())
        stats = msgspec.structs.replace(
            stats,
            device_s=device_s,
            allocation=self._meter.allocation(),
            migrations=migrations,
        )
        self.history.append(stats)
        self._metrics.write(stats)
        every = self.cfg.run.checkpoint_every
        if every and (index + 1) % every == 0:
            await self.save_checkpoint()
        return stats

    async def run(self, num_iterations: int | None = None) -> list[IterationStats]:
        """Run to ``num_iterations`` iterations (default ``cfg.run.num_iterations``),
        save a final checkpoint, and return every iteration's stats."""
        async for _ in self.iterations(num_iterations):
            pass
        await self.save_checkpoint()
        return list(self.history)

    async def save_checkpoint(self) -> Path:
        """Write the actor's model and optimizer state to
        ``checkpoints/iter_NNNN.pt`` in the run directory; returns the path."""
        if self._iteration is None or self._iteration.world.trainer is None:
            raise DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        path = self.run_dir / "checkpoints" / f"iter_{len(self.history):04d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        pool = self._iteration.world.trainer.pool
        await anyio.to_thread.run_sync(pool.save_checkpoint, path)
        return path
