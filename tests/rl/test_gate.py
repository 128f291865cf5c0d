"""The trainer's step gate opens and closes with the controller's events, and a step
waiting on it wakes when it opens (no polling)."""

import anyio

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.topology import ACTOR, ROLLOUT
from dynarl.core.ids import DeviceId, InstanceId, MigrationId
from dynarl.rl.gate import StepGate


def applied(graph, gate, event) -> None:  # type: ignore[no-untyped-def]
    graph.apply(event)
    gate(event)


async def test_a_waiting_step_starts_once_no_move_and_no_hold_stops_it() -> None:
    graph, _ = build_hypergraph(DynaRLConfig().pipeline_layout())  # actor-0 on device 0
    gate = StepGate(graph, ACTOR)
    assert gate.is_open()
    move = Migration(
        id=MigrationId(1),
        kind="reshard",
        src=ROLLOUT,
        dst=ACTOR,
        devices=(DeviceId(1),),
        drain=(InstanceId("rollout-0"),),
        create=(InstanceSpec(id=InstanceId("actor-1"), devices=(DeviceId(1),)),),
    )
    applied(graph, gate, ev.MigrationStarted(migration=move))
    assert not gate.is_open()
    started: list[list[str]] = []

    async def step() -> None:
        started.append([n.id for n in await gate.wait()])

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        await anyio.wait_all_tasks_blocked()
        assert not started
        applied(graph, gate, ev.StepsHeld(component=ACTOR, held=True))
        applied(graph, gate, ev.MigrationDone(migration=move.id))
        await anyio.wait_all_tasks_blocked()
        assert not started, "a held trainer started a step"
        applied(graph, gate, ev.StepsHeld(component=ACTOR, held=False))
    assert started == [["actor-0", "actor-1"]]
