"""The inference side of :class:`~dynarl.sim.world.SimWorld`: its modelled replicas
behind the real data plane's placement.

Finished responses are routed to the log-prob (reward/reference) replicas by a
:class:`~dynarl.data.placement.Placement` of their own edge (``to_inference``), the data
router's bookkeeping and decisions, as in a real run: each replica is a
:class:`~dynarl.data.peers.WorkerState` with the real
:class:`~dynarl.data.request_queue.RequestQueue` (FIFO) in front of it, the
:class:`~dynarl.data.routing.AffinityRouting` policy (seeded with the run's seed)
places each sample on the less loaded of two replicas, and a replica with room takes
the samples waiting at the busiest (``Placement.steal_for``). A replica declares a
capacity of one micro-batch: the router keeps that many in flight on it, which the
modelled replica (:class:`~dynarl.sim.stages.InferenceStage`) runs as its next
forward pass; what it finishes comes back as the ``done``
:class:`~dynarl.data.wire.ItemResult` a real worker would send. A drained or failed
replica's samples are aborted and routed again (its running micro-batch is lost).
Placement reports every move (``ItemsEnqueued``, ``ItemRouted``, ``ItemsRequeued``,
``ItemCompleted``, ``WorkerFailed``).
"""

from collections.abc import Callable, Sequence

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import INFERENCE, TO_INFERENCE
from dynarl.core.clock import Clock
from dynarl.core.ids import InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.peers import RouterConfig, WorkerState
from dynarl.data.placement import Placement
from dynarl.data.request_order import order_named
from dynarl.data.routing import AffinityRouting
from dynarl.data.transport import PeerId
from dynarl.sim.stages import InferenceStage


class InferenceFleet:
    """The live inference replicas and the data plane's placement in front of them.

    Args:
        graph: the controller's hypergraph, read to see the inference instances.
        emit: where events go (``Controller.handle``).
        clock: the controller's clock (where the request queues measure waits).
        stage: the modelled replicas (their timing).
        seed: seed of the routing policy's random choices.
        router: the data router's configuration (queue sizes, aging).
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        clock: Clock,
        stage: InferenceStage,
        *,
        seed: int,
        router: RouterConfig | None = None,
    ) -> None:
        self.graph = graph
        self.clock = clock
        self.stage = stage
        self.router = router or RouterConfig()
        self.order = order_named("fifo")
        # A replica's running micro-batch is not recalled for a joining one (its work
        # would be lost, as a real inference worker's would): only queued samples move.
        self.placement = Placement(
            {TO_INFERENCE: (INFERENCE,)},
            policy=AffinityRouting(seed=seed),
            emit=emit,
            balance_on_join=self.router.balance_on_join,
            balance_below_share=self.router.balance_below_share,
        )
        self.workers: dict[InstanceId, WorkerState] = {}

    def sync(self, now: float) -> None:
        """Create modelled replicas for active inference instances that have none;
        each joins the placement (taking the backlog and samples waiting elsewhere)."""
        if INFERENCE not in self.graph.components:
            return
        for node in self.graph.components[INFERENCE].active_instances():
            if node.id in self.workers:
                continue
            self.stage.add(node.id)
            w = WorkerState.configured(
                PeerId(node.id.encode()),
                instance=node.id,
                component=INFERENCE,
                capacity=self.stage.micro_batch,
                config=self.router,
                order=self.order,
                clock=self.clock,
                now_s=now,
            )
            self.workers[node.id] = w
            self.placement.add_worker(w, now)

    def admit(self, samples: Sequence[ev.ItemRef], now: float) -> None:
        """Finished responses to score: reported and routed (``ItemsEnqueued``,
        ``ItemRouted``)."""
        self.placement.admit(
            [
                wire.Item(
                    id=s.id, group=s.group, edge=TO_INFERENCE, affinity="none", tokens=s.tokens
                )
                for s in samples
            ],
            now,
        )

    def route(self, now: float) -> None:
        """Feed each replica from its queue up to its capacity (a worker link's pump),
        then start the micro-batches of the idle replicas."""
        p = self.placement
        if p.backlog:
            p.refill(now)
        for iid, w in self.workers.items():
            room = w.capacity - len(w.in_flight)
            if room <= 0 or not len(w.queue):
                continue
            for item in w.queue.get_batch_nowait(room):
                w.in_flight.add(item)
                self.stage.assign(iid, item.id)
        self.stage.start(now)

    def completed(self, iid: InstanceId, items: list[ItemId], now: float) -> None:
        """Replica ``iid`` scored ``items`` (reported downstream first): each comes back
        to the placement as its worker's ``done`` result; the replica then takes samples
        waiting elsewhere if it has room."""
        w = self.workers[iid]
        for item in items:
            self.placement.on_result(w, wire.ItemResult(item=item), now)
        self.placement.after_results(w, now)

    def hold(self, iid: InstanceId, now: float) -> None:
        """Route nothing more to replica ``iid``: the placement routes its queued
        samples elsewhere; those in flight stay until :meth:`remove`."""
        self.placement.set_active(self.workers[iid], False, now)

    def remove(self, iid: InstanceId, now: float, *, failed: str | None = None) -> list[ItemId]:
        """Stop replica ``iid`` (its running micro-batch is lost) and route the samples it
        held elsewhere; with ``failed`` (a reason), report its worker failed
        (``WorkerFailed``). Returns the samples it held."""
        w, p = self.workers.pop(iid), self.placement
        held = [*w.in_flight, *(item.id for item in w.queue.queued())]
        self.stage.drain(iid, now)
        if failed is not None:
            p.fail_worker(w, failed, now)
            return held
        p.set_active(w, False, now)
        for item in list(w.in_flight):
            p.on_result(w, wire.ItemResult(item=item, status="aborted"), now)
        p.remove_worker(w)
        return held

    def plan(self, targets: Sequence[tuple[ItemId, InstanceId]]) -> None:
        """A migration's reassignment of samples to replicas (``Placement.plan``)."""
        self.placement.plan((item, target) for item, target in targets if target in self.workers)

    def busy(self) -> list[InstanceId]:
        """The replicas running a micro-batch."""
        return self.stage.busy()

    def next_time(self) -> float:
        """When the next micro-batch finishes (``inf`` if none runs)."""
        return self.stage.next_time()

    def set_slowdown(self, factor: float, now: float) -> None:
        """From ``now`` on, micro-batches take ``factor`` times their alone time."""
        self.stage.set_slowdown(factor, now)

    @property
    def busy_device_s(self) -> float:
        """Device-seconds the replicas have spent running micro-batches."""
        return self.stage.busy_device_s
