"""Hold the trainer at a step boundary when devices are about to join it.

An optimizer step runs to its end on the devices it started on. Started on a few
devices while the other stages finish their last work, it keeps the devices they free
waiting at its boundary (in a simulated 32B iteration, 32 devices for 270 s). When the
predictor says the step ends sooner if it waits for those devices (their stages'
predicted finish plus a reshard, then the step on all of them), the trainer is held:
its workers do not start the next step until the hold is lifted. The hold is
re-decided after every scheduling decision, also while moves are under way (their
devices count where they go), and lifts by itself once nothing is left upstream (then
no device is on its way).
"""

from dynarl.control.demand import Rates
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.control.scoring import demands, finish_times
from dynarl.core.ids import ComponentId


class HoldForDevices:
    """Hold trainers whose next step would finish sooner on devices still to come."""

    def __init__(self, predictor: Predictor, estimates: Estimates | None = None) -> None:
        self.predictor = predictor
        self.estimates = or_fresh(estimates)

    def holds(self, graph: Hypergraph) -> frozenset[ComponentId]:
        """Trainers to hold: those the predictor's schedule has wait for devices."""
        return frozenset(trainers_to_hold(graph, self.predictor, self.estimates))


def trainers_to_hold(
    graph: Hypergraph, predictor: Predictor, estimates: Estimates | None = None
) -> set[ComponentId]:
    """Trainers that should not start their next step yet: the placement as it is
    finishes sooner if that step waits for the devices their predecessors free when
    they finish (a step runs to its end on the devices it started on: started on a
    few, it keeps the freed devices waiting at its boundary).

    The devices of a move under way count where they go, once the move is done (its
    kind's cost from now, at most): a step boundary can come while another stage's
    devices are in transit, and the trainer must not start a long step on its few
    devices then because those devices were counted nowhere."""
    before = {c: n.num_active_devices for c, n in graph.components.items()}
    devices = dict(before)
    delays: dict[ComponentId, float] = {}
    for m in graph.migrations.values():
        if m.dst is None or not m.create:
            continue
        devices[m.dst] += sum(len(spec.devices) for spec in m.create)
        delays[m.dst] = max(delays.get(m.dst, 0.0), predictor.migration_cost(m.kind))
    waiting: set[ComponentId] = set()
    finish_times(
        graph,
        predictor,
        devices,
        before=before,
        delays=delays,
        waiting=waiting,
        estimates=estimates,
    )
    if graph.migrations:
        waiting |= _wait_for_idle_devices(graph, predictor, estimates)
    return waiting


def _wait_for_idle_devices(
    graph: Hypergraph, predictor: Predictor, estimates: Estimates | None
) -> set[ComponentId]:
    """While moves are under way the scheduler plans nothing until they land (each
    landing is a decision), and the devices of stages that have finished their work
    and expect none sit idle until then. A trainer that starts a step on its few
    devices in that window keeps them all waiting at its boundary (a simulated 7B step
    ran 151 s on 4 devices while 120 waited): hold each trainer whose next step ends
    sooner if it waits for them (the moves under way landing, then a reshard)."""
    idle = sum(
        n.num_active_devices
        for c, n in graph.components.items()
        if n.spec.kind != "actor"
        and n.num_active_devices
        and not graph.pending(c)
        and not any(graph.pending(a) for a in graph.ancestors[c])
    )
    if not idle:
        return set()
    join = max(predictor.migration_cost(m.kind) for m in graph.migrations.values())
    join += predictor.migration_cost("reshard")
    demand = demands(graph, estimates=estimates)
    rate_of = Rates(graph, predictor)
    out = set()
    for c, n in graph.components.items():
        d = demand.get(c) if n.spec.kind == "actor" else None
        if d is None or d.work <= 0 or not n.num_active_devices:
            continue
        unit = n.spec.devices_per_instance
        size = d.steps[0] if d.steps else d.tail
        pooled = n.num_active_devices + idle - idle % unit
        now, later = rate_of(c, n.num_active_devices, d), rate_of(c, pooled, d)
        if now > 0 and later > 0 and join + size / later < size / now:
            out.add(c)
    return out
