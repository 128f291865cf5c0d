"""Assembling a real run: the parts a configuration becomes, wired together and
entered on an exit stack in the order they must close in reverse.

:func:`check_backends` says first whether the backends the config names can run here;
:func:`assemble` then binds the data router (a private socket, or TCP for workers on
other nodes; each run has its own token that workers present at hello), builds the hypergraph,
starts the workers (:class:`~dynarl.api.world.RealWorld`), restores a checkpoint if
there is one, starts the controller with its listeners and returns the pipeline driver
that runs iterations over it all. Heavy modules (zmq, torch through the backends) load
here, not on ``import dynarl``.
"""

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.to_thread
import msgspec

from dynarl.api.checkpoint import Checkpoint
from dynarl.api.config import DynaRLConfig
from dynarl.api.engine_probe import engine_sizes_to_probe, observe_samples
from dynarl.api.run_dir import RunDirectory
from dynarl.api.world import RealWorld
from dynarl.control import events as ev
from dynarl.control.controller import Controller
from dynarl.control.pipeline import build_hypergraph, build_pipeline
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import Profile
from dynarl.control.topology import (
    ACTOR,
    INFERENCE,
    PROMPTS,
    ROLLOUT,
    TO_ACTOR,
    TO_INFERENCE,
    PipelineSpec,
)
from dynarl.core.clock import LoopClock
from dynarl.core.errors import ConfigError
from dynarl.envs.environment import EnvironmentSpec
from dynarl.envs.prompts import PromptSampler
from dynarl.obs.metrics import DeviceMeter
from dynarl.obs.timeline import TimelineRecorder
from dynarl.rl.pipeline import Pipeline
from dynarl.rl.progress import Progress
from dynarl.rl.trace import RunTrace

logger = logging.getLogger(__name__)


class Run(NamedTuple):
    """The assembled parts a facade keeps."""

    controller: Controller
    world: RealWorld
    pipeline: Pipeline
    meter: DeviceMeter
    recorder: TimelineRecorder
    sampler: PromptSampler


def slots_share_host(cfg: DynaRLConfig) -> bool:
    """Whether ``cfg``'s device slots compute on the cores of the controller's machine:
    CPU slots (``cluster.accelerator=cpu``, every stage on the torch reference workers)
    started by the local launcher. Otherwise (GPUs, SGLang, Megatron, Ray's other
    hosts) each device computes on its own silicon: the slots do not slow each other
    down, and the controller's CPU slows none of them."""
    on_cpu = (cfg.rollout.backend, cfg.inference.backend, cfg.actor.backend) == ("torch",) * 3
    return cfg.cluster.accelerator == "cpu" and cfg.cluster.launcher == "local" and on_cpu


def host_slowdown(cfg: DynaRLConfig) -> tuple[float, ...]:
    """The host curve the controller's predictor starts from: on slots sharing this
    machine's cores (:func:`slots_share_host`), ideal processor sharing of
    ``cluster.num_devices`` slots of ``cluster.threads_per_device`` threads on the cores
    this process may use (:func:`~dynarl.control.predictor.cores_slowdown`); otherwise
    none, the devices being independent."""
    from dynarl.control.predictor import cores_slowdown, usable_cores

    if not slots_share_host(cfg):
        return ()
    return cores_slowdown(cfg.cluster.num_devices, cfg.cluster.threads_per_device, usable_cores())


def check_backends(cfg: DynaRLConfig) -> None:
    """Raise :class:`~dynarl.ConfigError` unless every backend and the launcher the
    config names can run here with its values (see :mod:`dynarl.workers.backends`)."""
    from dynarl.launch import launchers
    from dynarl.workers import backends

    backends.check("rollout", cfg.rollout)
    backends.check("inference", cfg.inference)
    backends.check("actor", cfg.actor)
    launchers.check(cfg.cluster)
    cluster, rollout = cfg.cluster, cfg.rollout
    if (
        rollout.backend == "sglang"
        and rollout.sglang.launches
        and cluster.launcher == "ray"
        and cluster.accelerator == "cuda"
    ):
        from dynarl.workers.sglang.gpus import check_slot_gpus

        tail = rollout.tail_tp if cfg.scheduler.mode == "dynamic" else 0
        sizes = {"rollout.tp": rollout.tp, "rollout.tail_tp": tail}
        check_slot_gpus(sizes, cluster.ray.gpus_per_device)


_DEMOS_PER_STEP = 16
"""Demonstrations drawn per warm-start step."""


def environment_of(
    cfg: DynaRLConfig, environment: EnvironmentSpec | None
) -> EnvironmentSpec | None:
    """The multi-turn environment a run plays: the one given in code, or the built-in
    one ``env.name`` names (refused if both are given), or none."""
    if environment is not None and cfg.env.name is not None:
        raise ConfigError(
            f"the run is given an environment in code and env.name={cfg.env.name!r}; "
            "drop one of them",
            field="env.name",
        )
    if environment is not None:
        return environment
    if cfg.env.name is None:
        if cfg.env.warm_start_steps:
            raise ConfigError(
                "env.warm_start_steps needs an environment with demonstrations; the "
                "single-turn bracket task has none: set env.warm_start_steps=0",
                field="env.warm_start_steps",
            )
        return None
    from dynarl.envs.builtin import builtin_environment

    return builtin_environment(cfg.env.name, seed=cfg.run.seed)


def predictor_profile(
    cfg: DynaRLConfig, pipeline: PipelineSpec, resumed_dir: Path | None = None
) -> Profile | None:
    """What a real run's predictor starts from: the profile ``scheduler.predictor_profile``
    names, else the ``predictor.json`` of the run directory a resumed run continues
    (``resumed_dir``; one that cannot be read is logged and skipped), else nothing.

    Raises:
        ConfigError: the named profile is missing, unreadable, or measures components
            this pipeline does not have.
    """
    named = cfg.scheduler.predictor_profile
    if named is None:
        if resumed_dir is None:
            return None
        own = RunDirectory(resumed_dir).predictor_path
        if not own.is_file():
            return None
        try:
            return Profile.load(own)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Not needed to resume: the predictor learns afresh, as a new run's does.
            logger.warning("not starting the predictor from %s (%s)", own, exc)
            return None
    field = "scheduler.predictor_profile"
    try:
        profile = Profile.load(named)
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: {named} does not exist; name the predictor.json of an earlier "
            "run's directory, or leave it unset",
            field=field,
        ) from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"{field}: {named} is not a predictor profile ({exc})", field=field
        ) from None
    unknown = profile.components() - {c.id for c in pipeline.components}
    if unknown:
        raise ConfigError(
            f"{field}: {named} measures {sorted(unknown)}, which this pipeline does not "
            f"have (its components: {sorted(c.id for c in pipeline.components)})",
            field=field,
        )
    return profile


def check_predictor_profile(cfg: DynaRLConfig) -> None:
    """Refuse a ``scheduler.predictor_profile`` that cannot seed this run's predictor
    (see :func:`predictor_profile`), before the run writes or starts anything."""
    if cfg.scheduler.predictor_profile is not None:
        predictor_profile(cfg, build_pipeline(cfg.pipeline_layout())[0])


async def warm_started(
    cfg: DynaRLConfig, environment: EnvironmentSpec | None, run_dir: Path
) -> DynaRLConfig:
    """``cfg`` as the workers build it: with ``env.warm_start_steps``, its random-init
    policy is first trained on the environment's demonstrations (in a thread) and saved
    in the run directory, which ``model.path`` then names (a resumed run reuses it)."""
    steps = cfg.env.warm_start_steps
    if not steps or environment is None:
        return cfg
    demonstrations = environment.demonstrations
    if demonstrations is None or environment.task is None:
        raise ConfigError(
            f"env.warm_start_steps={steps} needs an environment with demonstrations and "
            f"tasks; {environment.name!r} has none: set env.warm_start_steps=0",
            field="env.warm_start_steps",
        )
    out = run_dir / "warm_start"
    if not (out / "config.json").is_file():
        from dynarl.workers import backends

        trainer = backends.trainer_backend(cfg.actor)
        tasks = environment.task
        # Demonstrations come from tasks far past those the run's iterations draw.
        demos = [demonstrations(tasks(1_000_000 + i)) for i in range(steps * _DEMOS_PER_STEP)]
        tools = environment.make().tools
        await anyio.to_thread.run_sync(
            lambda: trainer.warm_start(
                cfg.model,
                demos,
                tools=tools,
                steps=steps,
                lr=cfg.env.warm_start_lr,
                seed=cfg.run.seed,
                out_dir=out,
            )
        )
    model = msgspec.structs.replace(cfg.model, path=str(out.resolve()), tokenizer=None)
    return msgspec.structs.replace(
        cfg, model=model, env=msgspec.structs.replace(cfg.env, warm_start_steps=0)
    )


async def assemble(
    cfg: DynaRLConfig,
    stack: contextlib.AsyncExitStack,
    *,
    resumed: Checkpoint | None,
    on_progress: Callable[[Progress], None],
    before_controller: Callable[[], object],
    environment: EnvironmentSpec | None = None,
    run_dir: Path | None = None,
) -> Run:
    """The parts of a run of ``cfg``, entered on ``stack`` (leaving it stops them in
    reverse order); ``resumed`` continues from a checkpoint; ``before_controller`` is
    called just before the controller starts (what it pushes on ``stack`` runs once the
    controller has stopped); ``environment``: the multi-turn environment the episodes
    play (else the single-turn bracket task); ``run_dir``: the run directory (workers on
    other nodes copy their output to its ``workers/``; the pipeline records its
    ``trace.jsonl``)."""
    from dynarl.api.executor import WorldExecutor
    from dynarl.control.estimates import Estimates
    from dynarl.control.modes import make_hold, make_policy
    from dynarl.data import RouterConfig
    from dynarl.data.endpoint import new_token
    from dynarl.data.peers import with_balance
    from dynarl.data.request_order import order_named
    from dynarl.data.router import Router
    from dynarl.envs.prompts import prompt_sampler
    from dynarl.envs.synthetic import SyntheticTask
    from dynarl.envs.verifier import AsyncVerifier, MatchVerifier
    from dynarl.launch.binding import bind_controller
    from dynarl.rl.gate import StepGate
    from dynarl.rl.reporter import EventReporter
    from dynarl.workers.tokenizer import load_tokenizer

    ipc_dir = Path(tempfile.mkdtemp(prefix="dynarl-"))
    stack.callback(shutil.rmtree, ipc_dir, ignore_errors=True)
    transport, advertised = bind_controller(cfg.cluster, ipc_dir)
    stack.push_async_callback(transport.aclose)

    clock = LoopClock()
    graph, baseline = build_hypergraph(cfg.pipeline_layout(), now_s=clock.now())
    predictor = Predictor.for_pipeline(
        graph.spec,
        profile=predictor_profile(cfg, graph.spec, run_dir if resumed is not None else None),
        host_slowdown=host_slowdown(cfg),
    )
    meter = DeviceMeter(graph, now_s=clock.now())
    # Old log-probs come from inference instances, else from the engines' own.
    uses_inference = INFERENCE in graph.components
    successors = {PROMPTS: TO_INFERENCE, TO_INFERENCE: TO_ACTOR}
    world: RealWorld | None = None
    reporter = EventReporter(
        successors=successors if uses_inference else {PROMPTS: TO_ACTOR},
        known=lambda instance: instance in graph.instances,
        grows=frozenset({PROMPTS}),
        # The trainer's ranks (its workers) take the actor's samples for its replicas.
        replicas={TO_ACTOR: lambda worker: None if world is None else world.replica_of(worker)},
    )
    # Generous liveness: on a small CPU machine the slots share cores with training.
    router_cfg = with_balance(
        RouterConfig(heartbeat_interval_s=0.5, liveness_timeout_s=60.0), cfg.rollout.balance
    )
    router = await stack.enter_async_context(
        Router(
            transport,
            consumers={PROMPTS: [ROLLOUT], TO_INFERENCE: [INFERENCE], TO_ACTOR: [ACTOR]},
            config=router_cfg,
            order=order_named(cfg.rollout.request_order),
            on_event=reporter,
            token=new_token(),
            advertised_address=advertised,
        )
    )
    world = RealWorld(cfg, graph, router, log_dir=None if run_dir is None else run_dir / "workers")
    stack.push_async_callback(world.aclose)
    await world.start(probe_sizes=engine_sizes_to_probe(cfg, predictor))
    observe_samples(predictor, world.decode_samples)
    if resumed is not None:
        await _restore(world, resumed)
    # The timeline starts once the workers are up: start-up is not scheduling.
    recorder = TimelineRecorder(
        graph,
        run=cfg.scheduler.mode,
        offset_s=0.0 if resumed is None else resumed.state.timeline_s,
        now_s=clock.now(),
    )

    gate = StepGate(graph, ACTOR)
    executor = WorldExecutor(world)
    estimates = Estimates()  # what the policy and the hold read from the graph, shared
    controller = Controller(
        graph,
        make_policy(cfg.scheduler, predictor, baseline, estimates),
        executor,
        clock=clock,
        predictor=predictor,
        tick_s=cfg.scheduler.tick_s,
        listeners=[executor.on_event, meter, recorder, gate],
        hold=make_hold(cfg.scheduler, predictor, estimates),
    )
    before_controller()
    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)  # runs first on exit: stop the controller
    send, receive = anyio.create_memory_object_stream[ev.Event](0)
    stack.callback(send.close)
    await tg.start(controller.run, receive)
    reporter.connect(controller.handle)
    stack.callback(reporter.disconnect)  # nobody applies events after

    seed = cfg.run.seed
    tasks = environment.task if environment is not None else None
    sampler = prompt_sampler(
        cfg.data, seed=seed, generator=tasks or SyntheticTask(seed=seed).prompt
    )
    if resumed is not None:
        sampler.load_state_dict(resumed.state.sampler)
    assert world.trainer is not None, "the world starts its trainer"
    pipeline = Pipeline(
        algorithm=cfg.algorithm,
        rollout=cfg.rollout,
        seed=seed,
        router=router,
        trainer=world.trainer,
        weights=world.weights,
        gate=gate,
        reporter=reporter,
        sampler=sampler,
        verifier=AsyncVerifier(MatchVerifier()),
        tokenizer=load_tokenizer(cfg.model),
        uses_inference=uses_inference,
        on_progress=on_progress,
        environment=environment,
        env=cfg.env,
        max_seq_len=cfg.model.max_seq_len,
        trace=None if run_dir is None else _trace(cfg, run_dir, resumed, stack),
        carried=None if resumed is None else resumed.state.carried,
        tasks=tg,
    )
    stack.push_async_callback(pipeline.aclose)
    return Run(controller, world, pipeline, meter, recorder, sampler)


def _trace(
    cfg: DynaRLConfig,
    run_dir: Path,
    resumed: Checkpoint | None,
    stack: contextlib.AsyncExitStack,
) -> RunTrace:
    """The run directory's ``trace.jsonl``: kept up to a resumed run's checkpoint."""
    algo, m = cfg.algorithm, cfg.model
    meta = {
        "source": "dynarl run",
        "model": m.path or f"{m.arch} {m.num_layers}x{m.hidden_size}",
        "num_prompts": str(algo.num_prompts),
        "group_size": str(algo.group_size),
        "max_new_tokens": str(cfg.rollout.max_new_tokens),
        "scheduler": cfg.scheduler.mode,
        "seed": str(cfg.run.seed),
    }
    keep = None if resumed is None else resumed.state.num_iterations
    return stack.enter_context(RunTrace(run_dir / "trace.jsonl", keep_before=keep, meta=meta))


async def _restore(world: RealWorld, checkpoint: Checkpoint) -> None:
    """Load ``checkpoint`` into the started ``world``'s trainer and give the engines
    its weights under its weight version."""
    assert world.trainer is not None, "start the world first"
    trainer = world.trainer
    async with trainer.between_steps():
        await trainer.load_checkpoint(str(checkpoint.trainer_path))
    await world.weights.sync_weights(checkpoint.state.weight_version)
