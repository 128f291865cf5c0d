"""A run that stops making progress says so, instead of holding its devices forever.

A real run moves forward by events: items enqueued, routed, completed; tool calls
returning; optimizer steps done; migrations ending; workers failing. When none of these
happens for ``run.stall_timeout_s`` seconds while an iteration runs, something is waiting
on something that will not come (a lost message, an engine the router no longer routes
to, a collective a dead peer never joins), and waiting longer only burns the cluster's
time. :class:`StallWatch` stops the iteration then, and :func:`describe` says where the
work stands, the two views side by side (the controller's hypergraph and the router),
which is where a stuck run shows its cause: work queued for a component the router has no
active worker of, or a migration that never ended.
"""

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio

from dynarl.control import events as ev
from dynarl.core.errors import DynaRLError

if TYPE_CHECKING:
    from dynarl.control.hypergraph import Hypergraph
    from dynarl.data.router import Router

PROGRESS = (
    ev.ItemsEnqueued,
    ev.ItemRouted,
    ev.ItemsRequeued,
    ev.ItemsWithdrawn,
    ev.ItemCompleted,
    ev.ToolCallStarted,
    ev.ToolCallFinished,
    ev.TrainStepDone,
    ev.MigrationStarted,
    ev.MigrationDone,
    ev.MigrationFailed,
    ev.WorkerFailed,
    ev.IterationStarted,
    ev.IterationDone,
)
"""The events that count as progress."""

T = TypeVar("T")


class RunStalledError(DynaRLError):
    """An iteration made no progress for ``run.stall_timeout_s`` seconds."""


class StallWatch:
    """Watches a run's events for progress (see the module docstring).

    Args:
        timeout_s: seconds without progress that stop an iteration.
        clock: seconds, monotonic (default :func:`time.monotonic`).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._last = clock()
        self.stalled_s: float | None = None
        """How long the iteration had gone without progress when it was stopped."""

    def on_event(self, event: ev.Event) -> None:
        """Controller listener: progress events reset the watch."""
        if isinstance(event, PROGRESS):
            self._last = self._clock()

    def progress(self) -> None:
        """Something else moved forward (the trainer reported a stage)."""
        self._last = self._clock()

    async def watch(self, on_stall: Callable[[], object]) -> None:
        """Run beside an iteration: call ``on_stall`` (once) when it has gone
        ``timeout_s`` without progress, then return."""
        self._last = self._clock()
        self.stalled_s = None
        while True:
            idle = self._clock() - self._last
            if idle >= self.timeout_s:
                self.stalled_s = idle
                on_stall()
                return
            await anyio.sleep(min(self.timeout_s - idle, 5.0) + 0.01)

    async def watched(self, iteration: Awaitable[T], scope: anyio.CancelScope) -> T:
        """Await ``iteration`` beside :meth:`watch`, which cancels ``scope`` (the
        iteration's) when it stops making progress; :attr:`stalled_s` then says so."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.watch, scope.cancel)
            result = await iteration
            tg.cancel_scope.cancel()
        return result

    def error(
        self, index: int, resume: str, graph: "Hypergraph", router: "Router"
    ) -> RunStalledError:
        """The error that stops the run after iteration ``index`` stalled: how long,
        ``resume`` (where a resumed run continues), and :func:`describe`'s state."""
        return RunStalledError(
            f"iteration {index} made no progress for {self.stalled_s or 0:.0f} s "
            f"(run.stall_timeout_s={self.timeout_s:g}); the run stops ({resume}). "
            f"Where its work stands:\n{describe(graph, router)}"
        )


def describe(graph: "Hypergraph", router: "Router") -> str:
    """Where a run's work stands, in a few lines: per edge what is queued, held by
    instances and out on tool calls (the controller's view); per component its active
    instances in the hypergraph and in the router; the router's backlog; migrations that
    have not ended."""
    lines = []
    for edge in graph.edges.values():
        if not edge.items:
            continue
        at = sum(1 for s in edge.items.values() if s.owner is not None)
        lines.append(
            f"edge {edge.id}: {edge.num_pending} pending ({len(edge.queue)} queued, "
            f"{at - edge.num_in_tool} at instances, {edge.num_in_tool} in tool calls)"
        )
    for component, node in graph.components.items():
        active = sorted(i for i, n in node.instances.items() if n.state == "active")
        line = f"{component}: active instances {active or 'none'}"
        routed, idle = router.workers_of(component)
        if routed or idle:
            line += f"; the router routes to {sorted(routed) or 'none'}"
            line += f" (not to {sorted(idle)})" if idle else ""
        lines.append(line)
    stats = router.statistics()
    lines.append(
        f"router: {stats.num_backlog} items in its backlog, {stats.num_active} of "
        f"{stats.num_workers} workers active"
    )
    if graph.migrations:
        moving = ", ".join(
            f"{m.id} ({m.kind}, {m.src} -> {m.dst})" for m in graph.migrations.values()
        )
        lines.append(f"migrations not ended: {moving}")
    return "\n".join(lines)
