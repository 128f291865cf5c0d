"""The actor's readiness, signalled rather than polled: a trainer may start an
optimizer step once it holds devices, no move of them is under way (a move decided at
the last step boundary goes before the next step), and the controller does not hold it
(devices are on their way to it). The gate listens to the controller's events and
opens and closes with those facts."""

import anyio

from dynarl.control import events as ev
from dynarl.control.elements import Node
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import ComponentId

_CHANGES = (
    ev.MigrationStarted,
    ev.MigrationDone,
    ev.MigrationFailed,
    ev.WorkerFailed,
    ev.StepsHeld,
)


class StepGate:
    """Whether trainer ``component`` may start its next step; a controller listener.

    Args:
        graph: the controller's hypergraph (read after each event is applied).
        component: the trainer's component.
    """

    def __init__(self, graph: Hypergraph, component: ComponentId) -> None:
        self.graph = graph
        self.component = component
        self._opened = anyio.Event()
        self._check()

    def __call__(self, event: ev.Event) -> None:
        """Listener: look again after the events that change the answer."""
        if isinstance(event, _CHANGES):
            self._check()

    def instances(self) -> list[Node]:
        """The trainer's active instances, by id."""
        node = self.graph.components[self.component]
        return sorted(node.active_instances(), key=lambda n: n.id)

    def is_open(self) -> bool:
        """Whether a step may start now."""
        node = self.graph.components[self.component]
        moving = any(self.component in (m.src, m.dst) for m in self.graph.migrations.values())
        return bool(self.instances()) and not moving and not node.hold_steps

    async def wait(self) -> list[Node]:
        """Wait until a step may start; returns the trainer's instances then."""
        while not self.is_open():
            if self._opened.is_set():  # it closed since it was last opened
                self._opened = anyio.Event()
            await self._opened.wait()
        return self.instances()

    def _check(self) -> None:
        if self.is_open():
            self._opened.set()
