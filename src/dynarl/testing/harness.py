"""Run the real controller against a :class:`~dynarl.testing.world.FakeWorld`."""

from collections.abc import Callable

import anyio
import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.controller import Controller, ControllerStats
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.modes import make_hold, make_policy
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.plan import Migration
from dynarl.control.predictor import Predictor
from dynarl.control.predictor_profile import Profile, ProfileRow
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT
from dynarl.core.clock import LoopClock
from dynarl.core.errors import ConfigError
from dynarl.testing.world import FakeWorld, FakeWorldConfig


class HarnessResult(msgspec.Struct, kw_only=True):
    """What a harness run measured.

    ``allocation`` holds ``(time_s, devices per component)`` after every placement
    change; ``busy_device_s`` the device-seconds each component held devices.
    """

    iteration_times_s: list[float]
    tokens_generated: int
    stats: ControllerStats
    allocation: list[tuple[float, dict[str, int]]]
    migrations: list[Migration]


def fake_profile(world: FakeWorldConfig, max_devices: int) -> Profile:
    """The throughputs a :class:`FakeWorld` delivers, as a profile seeding the predictor
    (what a short profiling run would measure)."""
    rows = []
    for n in range(1, max_devices + 1):
        for load in (1, 4, 16, 64, 256):
            running = min(load, world.max_running * n)
            step = world.step_s + world.per_seq_s * running / n
            rows.append(
                ProfileRow(component=ROLLOUT, devices=n, load=running, throughput=running / step)
            )
        rows.append(
            ProfileRow(
                component=INFERENCE,
                devices=n,
                load=1024,
                throughput=n * world.inference_items_per_s,
            )
        )
        rows.append(
            ProfileRow(
                component=ACTOR, devices=n, load=1024, throughput=n * world.actor_items_per_s
            )
        )
    return Profile(rows=tuple(rows), migration_s=dict(world.migration_s))


async def run_with_fake_world(
    cfg: DynaRLConfig,
    world_cfg: FakeWorldConfig,
    *,
    profile: Profile | None = None,
    check: bool = False,
    fail: Callable[[Migration], bool] = lambda m: False,
) -> HarnessResult:
    """Run ``world_cfg``'s iterations under ``cfg.scheduler`` on the running loop.

    With ``check`` the hypergraph's invariants are verified after every event. Run it
    on a :class:`~dynarl.core.virtual_time.VirtualTimeLoop` to take no real time.
    """
    if cfg.scheduler.predictor_profile is not None:
        raise ConfigError(
            "the fake world seeds the scheduler's predictor with its own profile: "
            "scheduler.predictor_profile applies to real runs; unset it",
            field="scheduler.predictor_profile",
        )
    clock = LoopClock()
    graph, baseline = build_hypergraph(cfg.pipeline_layout(), now_s=clock.now())
    predictor = Predictor.for_pipeline(graph.spec, profile=profile)
    policy = make_policy(cfg.scheduler, predictor, baseline)
    allocation: list[tuple[float, dict[str, int]]] = []
    migrations: list[Migration] = []

    def listen(event: ev.Event) -> None:
        if check:
            graph.check()
        if isinstance(event, ev.MigrationStarted):
            migrations.append(event.migration)
        if isinstance(event, ev.MigrationStarted | ev.MigrationDone | ev.MigrationFailed):
            allocation.append((event.time_s, _devices(graph)))

    # The world reports to the controller, which uses the world as its executor.
    def handle(event: ev.Event) -> None:
        controller.handle(event)  # bound below: the controller needs the world first

    world = FakeWorld(graph, handle, clock, world_cfg, fail=fail)
    controller: Controller = Controller(
        graph,
        policy,
        world,
        clock=clock,
        predictor=predictor,
        tick_s=cfg.scheduler.tick_s,
        listeners=[listen],
        hold=make_hold(cfg.scheduler, predictor),
    )
    allocation.append((clock.now(), _devices(graph)))
    send, receive = anyio.create_memory_object_stream[ev.Event](0)
    async with anyio.create_task_group() as tg, send:
        await tg.start(controller.run, receive)
        await world.run()
    return HarnessResult(
        iteration_times_s=world.iteration_times_s,
        tokens_generated=world.tokens_generated,
        stats=controller.statistics(),
        allocation=allocation,
        migrations=migrations,
    )


def _devices(graph: Hypergraph) -> dict[str, int]:
    return {str(c): n.num_active_devices for c, n in graph.components.items() if n.spec.on_devices}
