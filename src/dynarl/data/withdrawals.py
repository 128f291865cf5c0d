"""Items withdrawn while they ran (a partial rollout's end), until they leave the run.

Each comes back through its worker's result (``aborted`` with its partial output, or
finished first), except when the worker fails meanwhile: the placement then takes the
item out of the run, and no worker will answer for it, so the router hands it back to
its caller itself, ``aborted``, with the payload it was sent with.
"""

from collections.abc import Callable

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.placement import Placement, RoutedResult


class Withdrawals:
    """The in-flight items being withdrawn, as they were sent, and where.

    Args:
        placement: the router's item table.
        hand_back: delivers a result no worker will send.
    """

    def __init__(self, placement: Placement, hand_back: Callable[[RoutedResult], None]) -> None:
        self._placement = placement
        self._hand_back = hand_back
        self._recalled: dict[ItemId, tuple[InstanceId, wire.Item]] = {}

    def note(self) -> None:
        """Remember the items the placement now recalls to take them out of the run."""
        p = self._placement
        for w in p.workers.values():
            for item_id in p.withdrawing.intersection(w.in_flight):
                self._recalled[item_id] = (w.instance, w.in_flight[item_id])

    def on_event(self, event: ev.Event) -> None:
        """Follow the recalled items as they leave: one that completed is forgotten;
        one withdrawn because its instance is gone (the worker failed) is handed back."""
        if not self._recalled:
            return
        if isinstance(event, ev.ItemCompleted):
            self._recalled.pop(event.item, None)
        elif isinstance(event, ev.ItemsWithdrawn):
            for item_id in event.items:
                recalled = self._recalled.pop(item_id, None)
                if recalled is None or recalled[0] in self._placement.workers:
                    continue  # taken at once, or its aborted result is on its way
                instance, item = recalled
                result = wire.ItemResult(item=item_id, status="aborted", payload=item.payload)
                self._hand_back(RoutedResult(item=item, result=result, instance=instance))
