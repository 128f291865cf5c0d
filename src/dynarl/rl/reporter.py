"""The event reporter: the one place a real run's events pass on their way to the
controller, and the owner of the rule of which comes first.

The data router reports its routing (``ItemsEnqueued`` on submit, ``ItemRouted``,
``ItemsRequeued``, ``ItemCompleted``, ``WorkerIdle``, ``WorkerFailed``, engines'
``EngineStats``); the pipeline driver reports the iteration's boundaries and the
actor's steps. The rule:
when an item completes on an edge whose consumer feeds another stage, its
``ItemsEnqueued`` on that next edge is reported *before* its ``ItemCompleted``, so
between two events the pipeline's work never seems to vanish (the hypergraph's
scheduler would see an idle stage). When the driver later submits the item on the
next edge, the router's own ``ItemsEnqueued`` for it is not reported again; an item
announced there that does not go on in this iteration (a partial rollout's sample of a
group it does not train) leaves it (:meth:`EventReporter.set_aside`).
"""

from collections.abc import Callable, Iterable, Mapping

import msgspec

from dynarl.control import events as ev
from dynarl.core.ids import EdgeId, InstanceId, ItemId

Emit = Callable[[ev.Event], None]


class EventReporter:
    """Forwards events, in the order the hypergraph accepts, to where :meth:`connect`
    points it (the controller's ``handle``); events before that, or after
    :meth:`disconnect`, are dropped (nobody would apply them).

    Args:
        successors: the edge a completed item goes on next (absent: it leaves the
            pipeline), e.g. ``prompts -> to_inference -> to_actor``.
        known: whether an instance is in the controller's model; a slot reports load
            as the instance it is becoming before the migration that creates it is
            done (or as the one it left), which is not news to the model, and a
            trainer rank's idleness is not its replica's.
        grows: edges whose completed items grow by the tokens the instance produced
            (rollout: a sample is its prompt plus its response).
        replicas: edges whose consumers' workers are not the model's instances (the
            trainer's ranks serve the actor's replicas), with the replica each worker
            serves now; an item is reported on the replica it was routed to.
    """

    def __init__(
        self,
        *,
        successors: Mapping[EdgeId, EdgeId],
        known: Callable[[InstanceId], bool],
        grows: frozenset[EdgeId] = frozenset(),
        replicas: Mapping[EdgeId, Callable[[InstanceId], InstanceId | None]] | None = None,
    ) -> None:
        self._emit: Emit | None = None
        self._successors = dict(successors)
        self._known = known
        self._grows = grows
        self._refs: dict[tuple[EdgeId, ItemId], ev.ItemRef] = {}
        self._announced: set[tuple[EdgeId, ItemId]] = set()
        self._replicas = dict(replicas or {})
        self._replica_of: dict[tuple[EdgeId, ItemId], InstanceId] = {}

    def connect(self, emit: Emit) -> None:
        """Report events to ``emit`` from now on."""
        self._emit = emit

    def disconnect(self) -> None:
        """Drop events from now on (the run is closing)."""
        self._emit = None

    def __call__(self, event: ev.Event) -> None:
        """Report ``event`` (the router's callback, and the driver's own events)."""
        emit = self._emit
        if emit is None:
            return
        if isinstance(event, ev.EngineStats | ev.WorkerIdle) and not self._known(event.instance):
            # (A trainer rank left with nothing: its replica's other ranks may still
            # work, and the model knows only the replica.)
            return
        if isinstance(event, ev.WorkerFailed) and not self._known(event.instance):
            # A trainer rank died: to the model, the replica it served is gone.
            for replica_of in self._replicas.values():
                replica = replica_of(event.instance)
                if replica is not None:
                    event = msgspec.structs.replace(event, instance=replica)
                    break
        if isinstance(event, ev.ItemsEnqueued):
            fresh = []
            for k, ref in enumerate(event.items):
                key = (event.edge, ref.id)
                self._refs[key] = ref
                if key in self._announced:
                    self._announced.discard(key)
                else:
                    fresh.append(k)
            if not fresh:
                return
            if len(fresh) != len(event.items):
                generated = event.generated
                event = ev.ItemsEnqueued(
                    edge=event.edge,
                    items=tuple(event.items[k] for k in fresh),
                    generated=tuple(generated[k] for k in fresh) if generated else (),
                    time_s=event.time_s,
                )
        elif isinstance(event, ev.ItemRouted) and event.edge in self._replicas:
            replica = self._replicas[event.edge](event.instance)
            if replica is None:
                return  # a worker that serves no replica now: nothing the model knows
            self._replica_of[(event.edge, event.item)] = replica
            event = msgspec.structs.replace(event, instance=replica)
        elif isinstance(event, ev.ItemCompleted):
            key = (event.edge, event.item)
            if event.edge in self._replicas:
                replica = self._replica_of.pop(key, None)
                if replica is None:
                    return
                event = msgspec.structs.replace(event, instance=replica)
            done = self._refs.pop(key) if key in self._refs else None
            after = self._successors.get(event.edge)
            if after is not None and done is not None:
                grown = event.num_tokens if event.edge in self._grows else 0
                sample = ev.ItemRef(done.id, done.group, done.tokens + grown)
                self._refs[(after, done.id)] = sample
                self._announced.add((after, done.id))
                emit(ev.ItemsEnqueued(edge=after, items=(sample,), time_s=event.time_s))
        emit(event)

    def set_aside(self, edge: EdgeId, ids: Iterable[ItemId]) -> None:
        """Items completed on ``edge`` do not go on to the next edge in this iteration
        (a partial rollout carries them over): those announced there leave it
        (``ItemsWithdrawn``), so the model does not wait for work that will not come."""
        after = self._successors.get(edge)
        if after is None:
            return
        leaving = []
        for item in ids:
            key = (after, item)
            if key in self._announced:
                self._announced.discard(key)
                self._refs.pop(key, None)
                leaving.append(item)
        if leaving and self._emit is not None:
            self._emit(ev.ItemsWithdrawn(edge=after, items=tuple(leaving)))

    def forget(self) -> None:
        """Drop what is known of items (a new iteration starts: none is in flight)."""
        self._refs.clear()
        self._announced.clear()
        self._replica_of.clear()
