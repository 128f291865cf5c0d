"""The remaining work of a component and the rate its devices get through it.

A :class:`Demand` is what one component still has to do this iteration, in the units its
throughput is measured in: tokens still to generate for rollout; for the other stages
the tokens of the samples they score or train, or items when the items carry no sizes.
:func:`~dynarl.control.scoring.demands` computes it for every component on devices.
:func:`rate` is the effective rate at which a component gets through its demand on a
given number of devices (for rollout, bounded by its longest response and its most
loaded engine). Both the scoring of placements (:mod:`dynarl.control.scoring`) and the
trainer's step model (:mod:`dynarl.control.trainer_steps`) build on them.
"""

from collections.abc import Mapping

from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.control.throughput_fit import busy_devices
from dynarl.core.ids import ComponentId


class Demand:
    """Remaining work of one component, in the units its throughput is measured in."""

    __slots__ = (
        "arriving",
        "context",
        "hottest",
        "load",
        "longest",
        "per_item",
        "ready",
        "running_since",
        "steps",
        "tail",
        "upstream",
        "work",
    )

    def __init__(
        self,
        work: float,
        load: float,
        tail: float,
        upstream: float = 0.0,
        longest: float = 0.0,
        *,
        hottest: float = 0.0,
        per_item: float = 1.0,
        steps: tuple[float, ...] = (),
        context: float = 0.0,
        ready: tuple[float, ...] = (),
        running_since: float | None = None,
        arriving: tuple[tuple[float, float], ...] = (),
    ) -> None:
        self.work = work  # units still to process
        self.longest = longest  # rollout: tokens of the longest remaining response
        self.load = load  # parallel work items (the batch it can run)
        self.tail = tail  # units left after its last input arrives
        self.upstream = upstream  # work (rollout: items) still on its way from predecessors
        self.hottest = hottest  # rollout: tokens queued on its most loaded engine
        self.per_item = per_item  # units of work per item
        # actor: the work of each remaining step in the order they run (empty: equal)
        self.steps = steps
        # rollout: mean tokens of context a remaining token attends to (its KV read)
        self.context = context
        # actor: when each remaining step's last sample arrives, as a share of the time
        # until its predecessors finish (empty: the samples arrive evenly)
        self.ready = ready
        # actor: when the step it is running began (None: no step is running)
        self.running_since = running_since
        # a stage fed by a rollout: its upstream work in the order it arrives, as
        # (share of the time until its predecessors finish, work) chunks (empty: unknown)
        self.arriving = arriving

    def with_hottest(self, num_items: int) -> "Demand":
        """The same demand with ``num_items`` items on the most loaded engine."""
        return Demand(
            self.work,
            self.load,
            self.tail,
            self.upstream,
            self.longest,
            hottest=num_items * self.per_item,
            per_item=self.per_item,
            steps=self.steps,
            context=self.context,
            ready=self.ready,
            running_since=self.running_since,
            arriving=self.arriving,
        )


def rate(
    graph: Hypergraph,
    predictor: Predictor,
    cid: ComponentId,
    devices: int,
    d: Demand,
    *,
    unit: int = 0,
) -> float:
    """Effective rate at which ``cid`` gets through its remaining work on ``devices``,
    its instances of ``unit`` devices each (0: their size now).

    For rollout with fitted step costs (:class:`~dynarl.control.predictor.StepCosts`)
    the finish time is ``a * longest + b' * work / devices``: every step pays the fixed
    cost ``a`` until the longest response ends, while a token's own cost ``b' = b + c
    * context + p`` (its request, the KV of its context -- ``d.context`` -- and its
    share of the engines' prefills, ``StepCosts.prefill``) is shared by
    the devices (those its requests can keep busy, one engine each at least:
    :func:`~dynarl.control.throughput_fit.busy_devices`). So the tail cannot be bought down
    with devices, and devices given to a rollout at its tail are wasted.
    With more requests than its engines run at once, rollout works in waves at full
    batch, ``work * (a + b' * cap) / (instances * cap)``, and the longest response may
    start only after them. Requests stay on the engine they were routed to, so the
    shared term is at least the most loaded engine's, ``b' * hottest / devices per
    engine``: devices added elsewhere do not shorten it. On devices sharing a host
    (:meth:`~dynarl.control.predictor.Predictor.slowdown`) the whole finish stretches
    by the slowdown at the devices kept busy.
    """
    load = max(d.load, 1.0)
    spec = graph.components[cid].spec
    unit = unit or spec.devices_per_instance
    costs = predictor.step_costs(cid, unit) if d.longest > 0 else None
    if costs is None or devices <= 0:
        context = d.context if d.context > 0 else None
        return predictor.predict(cid, devices, load, context=context, unit=unit).throughput
    a, b = costs.a, costs.per_token(d.context)
    busy = busy_devices(devices, load, unit)
    shared = b * d.work / busy
    if d.hottest > 0:
        shared = max(shared, b * d.hottest / unit)
    if spec.max_load_per_instance:
        cap = spec.max_load_per_instance
        instances = max(1, devices // unit)
        if load > cap * instances:
            # The longest response may wait behind the waves of the others.
            step = a + b * cap / unit
            shared = max(shared, d.work * step / (instances * cap))
    # Devices sharing a host's cores slow each other down (1.0 when independent).
    finish = (a * d.longest + shared) * predictor.slowdown(busy)
    return d.work / finish


class Rates:
    """:func:`rate` on one hypergraph and predictor, each answer kept.

    The candidate plans of one decision ask for the same rates over and over (a plan
    changes the devices of a few components; every other component's rate is the one
    the previous candidate used). Make one per decision and drop it: it does not see
    the hypergraph or the predictor change. Demands are told apart by identity (a
    :class:`Demand` is never changed after it is made), and each is kept alive by its
    entry, so an answer is never handed to another demand.
    """

    __slots__ = ("_graph", "_memo", "_predictor", "_units")

    def __init__(
        self,
        graph: Hypergraph,
        predictor: Predictor,
        units: Mapping[ComponentId, int] | None = None,
    ) -> None:
        self._graph = graph
        self._predictor = predictor
        self._units = dict(units or {})  # instance sizes other than the graph's
        self._memo: dict[tuple[ComponentId, int, Demand], float] = {}

    def __call__(self, cid: ComponentId, devices: int, d: Demand) -> float:
        """``rate(graph, predictor, cid, devices, d)``, at the instance size the
        ``units`` it was made with give ``cid`` (else its size now)."""
        key = (cid, devices, d)
        try:
            return self._memo[key]
        except KeyError:
            value = rate(
                self._graph, self._predictor, cid, devices, d, unit=self._units.get(cid, 0)
            )
            self._memo[key] = value
            return value
