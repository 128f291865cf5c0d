"""The parts of the hypergraph: items on hyperedges, worker nodes, component
hypernodes and dataflow hyperedges. :mod:`dynarl.control.hypergraph` keeps them
current; the scheduler reads them."""

from collections.abc import Iterable
from typing import Literal

from dynarl.control.meter import RateMeter
from dynarl.control.plan import InstanceSpec
from dynarl.control.topology import ComponentSpec, EdgeSpec
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId

TOOL = InstanceId("<tool>")
"""Owner of an item while it is out of its engine running a tool call."""

InstanceState = Literal["active", "draining"]


class ItemState:
    """One item on a hyperedge: who holds it and its affinity history."""

    __slots__ = (
        "enqueued_s",
        "group",
        "id",
        "last_instance",
        "owner",
        "prefix_tokens",
        "tokens",
        "tool_calls",
    )

    def __init__(self, item: ItemId, group: GroupId, enqueued_s: float, tokens: int = 0) -> None:
        self.id = item
        self.group = group
        self.tokens = tokens  # its size (ItemRef.tokens)
        self.owner: InstanceId | None = None  # None: waiting in the edge's queue
        self.last_instance: InstanceId | None = None
        self.tool_calls = 0
        self.prefix_tokens = 0
        self.enqueued_s = enqueued_s


class Node:
    """One worker instance and its last reported load."""

    __slots__ = (
        "below_since_s",
        "busy",
        "component",
        "devices",
        "gen_tokens_per_s",
        "held_since_s",
        "id",
        "items",
        "kv_usage",
        "last_stats_s",
        "num_queued",
        "num_running",
        "state",
    )

    def __init__(self, spec: InstanceSpec, component: ComponentId, now_s: float) -> None:
        self.id = spec.id
        self.component = component
        self.devices = spec.devices
        self.state: InstanceState = "active"
        self.items: dict[ItemId, EdgeId] = {}
        self.kv_usage = 0.0
        self.num_running = 0
        self.num_queued = 0
        self.gen_tokens_per_s = 0.0
        self.last_stats_s: float | None = None
        self.busy = False
        # Since when it has held at least one item (None while it holds none).
        self.held_since_s: float | None = None
        # Since when KV usage has stayed below the hypergraph's low-usage threshold.
        self.below_since_s: float | None = now_s


class HyperNode:
    """One component: static spec, its instances and measured rates."""

    def __init__(self, spec: ComponentSpec, *, rate_tau_s: float) -> None:
        self.spec = spec
        self.instances: dict[InstanceId, Node] = {}
        self.num_active = 0
        self.num_active_devices = 0
        self.work_rate = RateMeter(rate_tau_s)  # tokens/s (rollout) or samples/s
        self.items_completed = 0
        self.tokens_completed = 0
        # Work completed in the unit its throughput is measured in: for the stages
        # after rollout, tokens of the items it completed once items have sizes (else
        # items); rollout's work is the tokens it generates (``tokens_completed``).
        self.work_completed = 0.0
        # Longest response of finished iterations (this one's is biased short: its
        # longest responses have not finished yet) and of this one so far.
        self.max_tokens_completed = 0
        self.max_tokens_iter = 0
        # Rollout: the response lengths of this iteration so far, and those of the last
        # finished iteration (sorted, with suffix sums: the survivors' expectation).
        self.lengths_iter: list[int] = []
        self.lengths_prev: list[int] = []
        self.lengths_prev_suffix: list[float] = []
        # This iteration only: tokens generated (from engine reports) and completed.
        self.tokens_generated_iter = 0.0
        self.tokens_completed_iter = 0
        self.items_completed_iter = 0
        self.steps_done = 0
        self.num_steps = 0
        self.last_step_samples_per_s = 0.0
        # Set by the controller: its workers should not start their next step yet
        # (devices are on their way to it; see dynarl.control.policies.hold).
        self.hold_steps = False
        # Instance-seconds its instances spent holding items (finished spans only).
        self.occupied_s = 0.0

    @property
    def id(self) -> ComponentId:
        """The component's id."""
        return self.spec.id

    def restart_rate(self, time_s: float) -> None:
        """Measure the work rate afresh from ``time_s`` (the component was resized)."""
        self.work_rate.reset()
        self.work_rate.add(time_s, 0.0)

    def occupied_until(self, now_s: float) -> float:
        """Instance-seconds its instances have held items, up to ``now_s``.

        A stage whose instances hold items is working on them, so items completed per
        occupied instance-second is what its instances can do -- unlike its completion
        rate, which falls to its inputs' arrival rate whenever it waits for them.
        """
        running = sum(
            now_s - n.held_since_s for n in self.instances.values() if n.held_since_s is not None
        )
        return self.occupied_s + running

    def active_instances(self) -> Iterable[Node]:
        """Instances not being drained."""
        return (n for n in self.instances.values() if n.state == "active")

    def num_in_flight(self) -> int:
        """Items held by this component's active instances."""
        return sum(len(n.items) for n in self.active_instances())


class HyperEdge:
    """One dataflow: its items, its queue (insertion-ordered) and progress counters."""

    def __init__(self, spec: EdgeSpec) -> None:
        self.spec = spec
        self.items: dict[ItemId, ItemState] = {}
        self.queue: dict[ItemId, None] = {}
        self.num_in_tool = 0
        self.num_enqueued = 0
        self.enqueued_this_iteration = 0
        self.num_routed = 0
        self.num_requeued = 0
        self.num_completed = 0
        self.tokens_completed = 0
        self.tokens_pending = 0  # sizes (ItemRef.tokens, 1 at least) of its pending items

    @property
    def id(self) -> EdgeId:
        """The edge's id."""
        return self.spec.id

    @property
    def num_pending(self) -> int:
        """Items not yet completed (queued, in flight or in a tool call)."""
        return len(self.items)
