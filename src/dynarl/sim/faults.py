"""Faults injected into a simulated run: failed moves and killed modelled workers.

:class:`SimFaults` (off unless a simulation is given one) makes the simulated
cluster misbehave as a real one does, so the real controller's recovery can be soaked
on virtual time:

- **failed moves**: a migration fails before it touches anything (a worker refused
  it), or midway, after its instances were drained and their work requeued (a
  transfer timed out): the controller hears ``MigrationFailed``, the drained instances
  go back to work (their modelled engines restart and take the requeued work again),
  and the move is retried after the controller's back-off;
- **killed workers**: a rollout engine or inference replica dies at a random moment
  (also while it drains for a migration): the requests it held are requeued with the
  tokens they had generated, the controller hears ``WorkerFailed`` (the instance
  leaves the hypergraph, its devices are marked crashed) and the scheduler reboots an
  instance there or gives the work to the survivors.

Every fault is recorded with its kind and virtual time, and the time until the
system recovered from it (:class:`FaultRecord`), for the soak's table.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np

from dynarl.control import events as ev
from dynarl.control.plan import Migration
from dynarl.control.topology import INFERENCE, ROLLOUT
from dynarl.core.ids import InstanceId, ItemId
from dynarl.sim.errors import SimError

if TYPE_CHECKING:
    from dynarl.sim.world import SimWorld

FaultKind = Literal["move_refused", "move_failed_midway", "rollout_killed", "inference_killed"]
"""What a fault did."""


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How often faults happen in a simulated run (all off by default).

    Attributes:
        move_failure_rate: probability that a migration fails (half of the failures
            before it touches anything, half midway after draining).
        mean_kill_interval_s: mean virtual seconds between two killed workers
            (exponential); ``0`` kills none.
        seed: seed of the faults' randomness (independent of the run's).
    """

    move_failure_rate: float = 0.0
    mean_kill_interval_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.move_failure_rate < 1.0:
            raise ValueError(f"move_failure_rate={self.move_failure_rate} must be in [0, 1)")
        if self.mean_kill_interval_s < 0:
            raise ValueError(f"mean_kill_interval_s={self.mean_kill_interval_s} must be >= 0")


class FaultRecord(msgspec.Struct, kw_only=True):
    """One injected fault: its kind, when, what it hit, and when the system had
    recovered (``None`` while it has not): for a failed move, once a move to the same
    component succeeded (a plan the scheduler no longer wants stays ``None``); for a
    killed worker, once every request or sample it held runs again on another worker.
    ``lost_items``: what it held, requeued; ``devices``: a killed worker's devices,
    and ``devices_back_s`` when all of them were rebooted into an instance again."""

    kind: FaultKind
    time_s: float
    target: str
    recovered_s: float | None = None
    lost_items: int = 0
    devices: tuple[int, ...] = ()
    devices_back_s: float | None = None

    @property
    def device_downtime_s(self) -> float | None:
        """A killed worker's: seconds until its devices served an instance again."""
        return None if self.devices_back_s is None else self.devices_back_s - self.time_s

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the fault to recovery."""
        return None if self.recovered_s is None else self.recovered_s - self.time_s


class InjectedFaultError(SimError):
    """A failure the fault injector made."""


class SimFaults:
    """Injects ``plan``'s faults into ``world``; install with :meth:`install`, run
    :meth:`kill_loop` beside the world, and feed it every applied event
    (:meth:`on_event`) to time recoveries."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.rng = np.random.default_rng(plan.seed)
        self.records: list[FaultRecord] = []
        self._world: SimWorld | None = None
        # Open recoveries: failed moves by destination; kills by the items to run again.
        self._moves: list[tuple[FaultRecord, str | None]] = []
        self._kills: list[tuple[FaultRecord, set[ItemId]]] = []
        self._started: dict[int, tuple[str | None, str | None]] = {}  # migration: (src, dst)

    def install(self, world: "SimWorld") -> None:
        """Wrap ``world``'s executor so that migrations fail as the plan says."""
        self._world = world
        executor = world.executor
        execute = executor.execute

        async def failing_execute(migration: Migration) -> float:
            return await self._execute(execute, migration)

        executor.execute = failing_execute  # type: ignore[method-assign]

    async def _execute(
        self, execute: Callable[[Migration], "object"], migration: Migration
    ) -> float:
        world = self._world
        assert world is not None
        p = self.plan.move_failure_rate
        draw = self.rng.random()
        if draw < p / 2:
            self._record_move("move_refused", migration)
            raise InjectedFaultError(f"injected: migration {migration.id} refused")
        if draw < p:
            # Midway: the drained instances' work is taken back, then the move fails.
            world.executor.release(migration, world.now())
            await world.clock.sleep(world.cluster.migration.cost(migration.kind).setup_s)
            world.placement_changed()
            self._record_move("move_failed_midway", migration)
            raise InjectedFaultError(f"injected: migration {migration.id} failed midway")
        waited = await execute(migration)  # type: ignore[misc]
        assert isinstance(waited, float)
        return waited

    def _record_move(self, kind: FaultKind, migration: Migration) -> None:
        assert self._world is not None
        record = FaultRecord(
            kind=kind, time_s=self._world.now(), target=f"{migration.src}->{migration.dst}"
        )
        self.records.append(record)
        self._moves.append((record, migration.dst))

    async def kill_loop(self) -> None:
        """Kill a random rollout engine or inference replica every so often (the
        plan's mean interval), until cancelled."""
        world = self._world
        assert world is not None, "install first"
        mean = self.plan.mean_kill_interval_s
        if mean <= 0:
            return
        while True:
            await world.clock.sleep(float(self.rng.exponential(mean)))
            self.kill_one()

    def kill_one(self) -> FaultRecord | None:
        """Kill one random live rollout or inference worker now (none if none runs)."""
        world = self._world
        assert world is not None
        graph = world.graph
        victims = sorted(
            [iid for iid in world.engines if iid in graph.instances]
            + [iid for iid in world.inference.workers if iid in graph.instances]
        )
        if not victims:
            return None
        iid = InstanceId(victims[int(self.rng.integers(len(victims)))])
        component = graph.instances[iid].component
        devices = tuple(int(d) for d in graph.instances[iid].devices)
        now = world.now()
        if component == ROLLOUT:
            w = world.engines[iid].worker
            held = sorted([*w.in_flight, *(item.id for item in w.queue.queued())])
            world.remove_engine(iid, now, failed="fault injection: killed")
            kind: FaultKind = "rollout_killed"
        else:
            assert component == INFERENCE
            held = world.remove_replica(iid, now, failed="fault injection: killed")
            kind = "inference_killed"
        world.placement_changed()
        record = FaultRecord(
            kind=kind, time_s=now, target=str(iid), lost_items=len(held), devices=devices
        )
        self.records.append(record)
        if held:
            self._kills.append((record, set(held)))
        else:
            record.recovered_s = now
        return record

    def on_event(self, event: ev.Event) -> None:
        """Close the recoveries ``event`` completes."""
        world = self._world
        if world is None:
            return
        now = world.now()
        if isinstance(event, ev.MigrationStarted):
            m = event.migration
            self._started[m.id] = (m.src, m.dst)
        elif isinstance(event, ev.MigrationFailed):
            self._started.pop(event.migration, None)
        elif isinstance(event, ev.MigrationDone):
            move = self._started.pop(event.migration, None)
            for entry in list(self._moves):
                record, dst = entry
                if move is not None and move[1] == dst:
                    record.recovered_s = now
                    self._moves.remove(entry)
        if isinstance(event, ev.MigrationDone):
            crashed = world.graph.crashed_devices
            for record in self.records:
                if (
                    record.devices
                    and record.devices_back_s is None
                    and not any(d in crashed for d in record.devices)
                ):
                    record.devices_back_s = now
        if isinstance(event, ev.ItemRouted) and self._kills:
            for kill in list(self._kills):
                record, waiting = kill
                waiting.discard(event.item)
                if not waiting:
                    record.recovered_s = now
                    self._kills.remove(kill)

    def close(self, now_s: float) -> None:
        """The run ended: what is still open stays unrecovered (``None``)."""
        self._kills.clear()
        self._moves.clear()
