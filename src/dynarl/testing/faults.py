"""Fault injection into a real run: kill a chosen worker process at a chosen point.

A test fixture for real runs (off unless a test attaches one): a :class:`FaultInjector`
attached to an open :class:`~dynarl.api.facade.DynaRL` run watches the run's progress
and the controller's events and ``SIGKILL``\\ s the worker a :class:`WorkerKill` names
(the ``index``-th rollout slot, inference slot or trainer rank) when its point is
reached:

- ``rollout``: once half of the iteration's responses are done;
- ``scoring``: when a sample is routed to an inference instance;
- ``optimizer_step``: when an optimizer step of the iteration starts (for a trainer
  rank: the first step with that many ranks);
- ``migration``: when the controller starts a migration;
- ``reshard``: when the trainer starts a resize (its prepare goes to every trainer
  worker: a rank killed there dies while the others build the resize's groups with
  it); for a trainer rank, the first resize of the iteration from that many ranks;
- ``role_switch``: when slots start to assume a role (rollout or inference, as
  ``target`` says): the victim is the ``index``-th of those slots, killed while it
  builds the role and catches up on weights;
- ``weight_sync``: when the iteration's closing weight sync starts.

It also counts what the controller hears: every item each edge completes, per
iteration (:meth:`FaultInjector.completions`), so a test can check that no sample was
lost or duplicated, and records each kill with its time (:attr:`FaultInjector.kills`).
"""

import collections
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec

from dynarl.control import events as ev
from dynarl.core.errors import DynaRLError

if TYPE_CHECKING:
    from dynarl.api.facade import DynaRL
    from dynarl.rl.progress import Progress
    from dynarl.workers.handles import SlotHandle

Target = Literal["rollout", "inference", "trainer"]
"""Which kind of worker to kill."""

Point = Literal[
    "rollout", "scoring", "optimizer_step", "migration", "reshard", "role_switch", "weight_sync"
]
"""When to kill it."""


class WorkerKill(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Kill the ``index``-th worker of kind ``target`` (in slot order among those
    serving that role now; a trainer's in data-parallel rank order) at ``point`` of
    iteration ``iteration``."""

    target: Target
    point: Point
    iteration: int = 0
    index: int = 0


class KillRecord(msgspec.Struct, kw_only=True):
    """A kill that happened: what, whom (its name and pid), when (``time.monotonic``),
    when the controller heard of the death (``detected_s``: its ``WorkerFailed``; a
    trainer worker is not an instance and is not reported so) and when the iteration
    it hit completed (``iteration_done_s``)."""

    kill: WorkerKill
    worker: str
    pid: int
    time_s: float
    instance: str = ""
    detected_s: float | None = None
    iteration_done_s: float | None = None


class FaultInjector:
    """Kills workers of ``rl`` as ``kills`` say; call :meth:`attach` once the run is
    open.

    Args:
        rl: the run (opened before :meth:`attach`).
        kills: what to kill, and when; each fires at most once.
    """

    def __init__(self, rl: "DynaRL", kills: list[WorkerKill]) -> None:
        self.rl = rl
        self.pending = list(kills)
        self.kills: list[KillRecord] = []
        self.iteration = -1
        self._completed: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self._on_progress: Callable[[Progress], None] | None = None
        self._switch: tuple[str, list[SlotHandle]] | None = None  # slots taking a role now

    def attach(self) -> None:
        """Start watching the open run's progress and its controller's events."""
        controller = self.rl.controller
        if controller is None:
            raise DynaRLError("open the run first: `async with DynaRL(cfg) as rl:`")
        controller.listeners.append(self._on_event)
        self._on_progress = self.rl.on_progress
        self.rl.on_progress = self._progress
        world = self.rl._world
        assert world is not None, "an open run has a world"
        world.resize_listeners.append(lambda _: self._fire("reshard"))
        world.switch_listeners.append(self._switching)

    def completions(self) -> dict[tuple[int, str], collections.Counter[str]]:
        """Per (iteration, edge): how many times each item completed it."""
        out: dict[tuple[int, str], collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        for (iteration, edge, item), n in self._completed.items():
            out[(iteration, edge)][item] += n
        return dict(out)

    # ------------------------------------------------------------------ triggers

    def _progress(self, p: "Progress") -> None:
        if self._on_progress is not None:
            self._on_progress(p)
        if p.stage == "rollout" and p.total and 2 * p.done >= p.total:
            self._fire("rollout")
        elif p.stage == "train":
            self._fire("optimizer_step")
        elif p.stage == "sync":
            self._fire("weight_sync")

    def _on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.IterationStarted):
            self.iteration = event.iteration
        elif isinstance(event, ev.ItemCompleted):
            self._completed[(self.iteration, event.edge, event.item)] += 1
        elif isinstance(event, ev.WorkerFailed):
            for record in self.kills:
                if record.instance == event.instance and record.detected_s is None:
                    record.detected_s = time.monotonic()
        elif isinstance(event, ev.IterationDone):
            for record in self.kills:
                if record.kill.iteration == event.iteration and record.iteration_done_s is None:
                    record.iteration_done_s = time.monotonic()
        elif isinstance(event, ev.MigrationStarted):
            self._fire("migration")
        elif isinstance(event, ev.ItemRouted) and event.edge == "to_inference":
            self._fire("scoring")

    def _switching(self, role: str, slots: "list[SlotHandle]") -> None:
        self._switch = (role, slots)
        try:
            self._fire("role_switch")
        finally:
            self._switch = None

    def _fire(self, point: Point) -> None:
        for kill in list(self.pending):
            if kill.point == point and kill.iteration == self.iteration:
                ranked = point == "optimizer_step" or (
                    point == "reshard" and kill.target == "trainer"
                )
                if point == "role_switch" and not self._switching_slot(kill):
                    continue  # not enough slots take that role in this switch
                if ranked and not self._has_rank(kill.index):
                    continue  # not that many ranks yet: a later step or resize
                self.pending.remove(kill)
                self._kill(kill)

    def _switching_slot(self, kill: WorkerKill) -> "SlotHandle | None":
        if self._switch is None or self._switch[0] != kill.target:
            return None
        slots = self._switch[1]
        return slots[kill.index] if 0 <= kill.index < len(slots) else None

    def _has_rank(self, index: int) -> bool:
        world = self.rl._world
        trainer = None if world is None else world.trainer
        return trainer is not None and index < len(trainer.rank_instances())

    def _kill(self, kill: WorkerKill) -> None:
        name, pid, instance = self._victim(kill)
        os.kill(pid, signal.SIGKILL)
        self.kills.append(
            KillRecord(kill=kill, worker=name, pid=pid, time_s=time.monotonic(), instance=instance)
        )

    def _victim(self, kill: WorkerKill) -> tuple[str, int, str]:
        world = self.rl._world
        if world is None:
            raise DynaRLError("the run is not open")
        switching = self._switching_slot(kill) if kill.point == "role_switch" else None
        if switching is not None:
            assert switching.pid is not None, "a started slot has a pid"
            return switching.name, switching.pid, str(switching.instance)
        if kill.target == "trainer":
            assert world.trainer is not None, "an open run has a trainer"
            by_name = {h.name: h for h in world.trainer_workers}
            handles = [by_name[name] for name in world.trainer.rank_instances()]
        else:
            handles = [h for h in world.serving_slots if h.role == kill.target]
        if not 0 <= kill.index < len(handles):
            raise DynaRLError(
                f"no {kill.target} worker {kill.index} to kill at {kill.point}: "
                f"{len(handles)} serve now"
            )
        handle = handles[kill.index]
        assert handle.pid is not None, "a started worker has a pid"
        return handle.name, handle.pid, str(handle.instance)
