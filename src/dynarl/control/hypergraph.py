"""The hypergraph: the controller's live, incrementally updated model of the pipeline.

A *hypernode* per component holds its static spec and dynamic facts (instances,
devices, utilisation, queue depth, throughput); a *node* per worker instance holds its
devices and load; a *hyperedge* per dataflow holds its items, each owned by exactly one
consumer instance, the tool stage, or the edge's queue. Device placement says which
instance (or migration, or the free pool) holds every device. The hypergraph keeps that
state; :mod:`dynarl.control.item_flow` holds the code that moves items (enqueue, route,
requeue, tool calls, completion) and :mod:`dynarl.control.device_placement` the code
that changes the placement (instance creation and removal, migrations, worker failures).

:meth:`Hypergraph.apply` updates it from one event in O(1) or O(items affected); it
validates before it mutates, so a rejected event (:class:`EventError`) changes nothing.
:meth:`Hypergraph.check` verifies the invariants from scratch (for tests and debugging).
"""

import itertools
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from dynarl.control import device_placement, item_flow
from dynarl.control import events as ev
from dynarl.control.elements import HyperEdge, HyperNode, ItemState, Node, sorted_arrays
from dynarl.control.invariants import check_invariants
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.topology import PipelineSpec
from dynarl.core.errors import EventError
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, MigrationId


class Hypergraph:
    """Live model of the pipeline, updated event by event.

    Iterations, engine stats and trainer steps are handled here; the item events
    (``ItemsEnqueued``, ``ItemRouted``, ``ItemsRequeued``, ``ItemsWithdrawn``, ``ItemCompleted``,
    ``ToolCallStarted``, ``ToolCallFinished``) by the functions of
    :mod:`dynarl.control.item_flow`, and the placement events (``MigrationStarted``,
    ``MigrationDone``, ``MigrationFailed``, ``WorkerFailed``) by those of
    :mod:`dynarl.control.device_placement`, all registered in the same handler table.

    Args:
        spec: components and dataflows.
        num_devices: devices in the cluster, ids ``0 .. num_devices - 1``.
        placement: initial instances per component; devices not placed are free.
        u_low: KV-usage threshold below which a rollout engine counts as low
            (the donor signal); the time it has stayed below is tracked per engine.
        expected_tokens_per_request: prior for the response length before any
            request of the run has completed (refined from completions).
        max_tokens_per_request: the response-length cap: the prior for the longest
            response (refined by the longest one seen).
        rate_tau_s: time constant of the measured work rates.
        now_s: time of construction.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        num_devices: int,
        placement: Mapping[ComponentId, Iterable[InstanceSpec]],
        u_low: float = 0.2,
        expected_tokens_per_request: float = 256.0,
        max_tokens_per_request: float = 1024.0,
        rate_tau_s: float = 5.0,
        now_s: float = 0.0,
    ) -> None:
        self.spec = spec
        self.num_devices = num_devices
        self.u_low = u_low
        self.rate_tau_s = rate_tau_s
        self.expected_tokens_per_request = expected_tokens_per_request
        self.max_tokens_per_request = max_tokens_per_request
        self.now_s = now_s
        self.iteration = -1
        self.iteration_started_s = now_s
        self.groups_to_complete: int | None = None  # partial rollouts: groups_needed
        self.groups_due: frozenset[GroupId] = frozenset()
        self.group_size = 0  # samples per group, if the iteration said
        self.components: dict[ComponentId, HyperNode] = {
            c.id: HyperNode(c, rate_tau_s=rate_tau_s) for c in spec.components
        }
        self.edges: dict[EdgeId, HyperEdge] = {e.id: HyperEdge(e) for e in spec.edges}
        # The pipeline's shape, asked for on every scoring: computed once.
        self.stage_order: tuple[ComponentId, ...] = spec.stage_order()
        """Components on devices in dataflow order."""
        self.predecessors: dict[ComponentId, tuple[ComponentId, ...]] = {
            c.id: spec.predecessors(c.id) for c in spec.components
        }
        """Components feeding each component."""
        self.ancestors: dict[ComponentId, frozenset[ComponentId]] = {
            c.id: frozenset(spec.ancestors(c.id)) for c in spec.components
        }
        """Components feeding each component, directly or through others."""
        self._edges_into: dict[ComponentId, list[HyperEdge]] = {
            c.id: [e for e in self.edges.values() if c.id in e.spec.consumers]
            for c in spec.components
        }
        self.instances: dict[InstanceId, Node] = {}
        self.device_owner: dict[DeviceId, InstanceId | MigrationId] = {}
        self.free_devices: set[DeviceId] = set(DeviceId(d) for d in range(num_devices))
        # Free devices whose worker crashed: using them again means a reboot.
        self.crashed_devices: set[DeviceId] = set()
        self.crashed_in_migration: set[DeviceId] = set()
        """Devices whose instance crashed while a migration drained it: they belong to
        the migration, and join :attr:`crashed_devices` if it leaves them free."""
        self.migrations: dict[MigrationId, Migration] = {}
        self.next_migration_id = MigrationId(0)
        # The serial of each component's next instance (device_placement keeps it).
        self._instance_serial: dict[ComponentId, int] = dict.fromkeys(self.components, 0)
        self.events_applied = 0
        # Whether items carry sizes (ItemRef.tokens): from the first sized item on, the
        # stages after rollout measure their work in tokens (see :meth:`work_pending`).
        self.sized = False
        device_placement.place_initial(self, placement)
        self._handlers: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.IterationStarted: self._on_iteration_started,
            ev.IterationDone: self._on_iteration_done,
            # Items: see dynarl.control.item_flow.
            ev.ItemsEnqueued: partial(item_flow.on_items_enqueued, self),
            ev.ItemRouted: partial(item_flow.on_item_routed, self),
            ev.ItemsRequeued: partial(item_flow.on_items_requeued, self),
            ev.ItemsWithdrawn: partial(item_flow.on_items_withdrawn, self),
            ev.ItemCompleted: partial(item_flow.on_item_completed, self),
            ev.ToolCallStarted: partial(item_flow.on_tool_call_started, self),
            ev.ToolCallFinished: partial(item_flow.on_tool_call_finished, self),
            ev.EngineStats: self._on_engine_stats,
            ev.WorkerIdle: self._on_worker_idle,
            ev.TrainStepDone: self._on_train_step_done,
            ev.StepsHeld: self._on_steps_held,
            # Device placement: see dynarl.control.device_placement.
            ev.MigrationStarted: partial(device_placement.on_migration_started, self),
            ev.MigrationDone: partial(device_placement.on_migration_done, self),
            ev.MigrationFailed: partial(device_placement.on_migration_failed, self),
            ev.WorkerFailed: partial(device_placement.on_worker_failed, self),
        }

    # ------------------------------------------------------------------ queries

    def new_instance_id(self, component: ComponentId, offset: int = 0) -> InstanceId:
        """The id the ``offset``-th next instance of ``component`` will get."""
        return InstanceId(f"{component}-{self._instance_serial[component] + offset}")

    def component_of(self, instance: InstanceId) -> HyperNode:
        """The hypernode an instance belongs to."""
        return self.components[self.instances[instance].component]

    def edges_into(self, component: ComponentId) -> list[HyperEdge]:
        """Edges ``component`` consumes (do not change the list)."""
        edges = self._edges_into.get(component)
        if edges is None:
            return [e for e in self.edges.values() if component in e.spec.consumers]
        return edges

    def queue_depth(self, component: ComponentId) -> int:
        """Items waiting in the queues of the edges ``component`` consumes."""
        return sum(len(e.queue) for e in self.edges_into(component))

    def waiting_for_slot(self, component: ComponentId) -> int:
        """Items ``component`` has not started for want of a slot: those in the queues
        of the edges it consumes (not yet routed) and, where an instance runs at most
        ``spec.max_load_per_instance`` items, those routed to an active instance beyond
        that (queued at the data router, which routes items as they arrive)."""
        depth = self.queue_depth(component)
        node = self.components[component]
        cap = node.spec.max_load_per_instance
        if cap:
            depth += sum(max(0, len(n.items) - cap) for n in node.active_instances())
        return depth

    def pending(self, component: ComponentId) -> int:
        """Items ``component`` has not yet completed: queued, in flight, in tools."""
        return sum(e.num_pending for e in self.edges_into(component))

    def groups_needed(self, component: ComponentId) -> int | None:
        """With partial rollouts (``IterationStarted.groups_to_complete``), how many
        more groups besides the due ones (:attr:`groups_due`, which it completes
        whatever else does) a rollout component must complete before its iteration's
        rollout ends (its other requests are then withdrawn); ``None``: it ends once
        every pending request has completed."""
        if self.groups_to_complete is None:
            return None
        done = sum(e.groups_done_this_iteration for e in self.edges_into(component))
        return max(self.groups_to_complete - done, 0)

    def utilisation(self, component: ComponentId) -> float:
        """Mean KV usage of a rollout component's engines; for others the busy
        fraction of its instances."""
        node = self.components[component]
        active = list(node.active_instances())
        if not active:
            return 0.0
        if node.spec.kind == "rollout":
            return sum(n.kv_usage for n in active) / len(active)
        return sum(n.busy for n in active) / len(active)

    def of_kind(self, kind: str) -> list[ComponentId]:
        """Components of ``kind`` (``"rollout"``, ``"actor"``, ...)."""
        return [c for c, n in self.components.items() if n.spec.kind == kind]

    def item_work(self, item: ItemState) -> float:
        """Work ``item`` is to a stage after rollout: its tokens once items carry sizes
        (the cost of scoring and training a sequence grows with its length), else 1."""
        return float(max(item.tokens, 1)) if self.sized else 1.0

    def work_pending(self, component: ComponentId) -> float:
        """Work ``component`` has not yet completed, in :meth:`item_work` units (for
        rollout, that is its requests' prompt tokens or count -- not its own work,
        which is the tokens it still generates)."""
        edges = self.edges_into(component)
        if self.sized:
            return float(sum(e.tokens_pending for e in edges))
        return float(sum(e.num_pending for e in edges))

    def low_for(self, instance: Node, now_s: float) -> float:
        """Seconds ``instance`` has kept KV usage below ``u_low`` (0 if it is above)."""
        return 0.0 if instance.below_since_s is None else now_s - instance.below_since_s

    # ------------------------------------------------------------------ updates

    def apply(self, event: ev.Event) -> None:
        """Apply one event; raises :class:`EventError` (changing nothing) if the event
        contradicts the model."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise EventError(f"no handler for event type {type(event).__name__}")
        handler(event)
        self.now_s = max(self.now_s, event.time_s)
        self.events_applied += 1

    def _on_iteration_started(self, e: ev.IterationStarted) -> None:
        if e.groups_to_complete is not None and e.groups_to_complete < 0:
            raise EventError(f"IterationStarted with {e.groups_to_complete} groups to complete")
        self.iteration = e.iteration
        self.iteration_started_s = e.time_s
        self.groups_to_complete = e.groups_to_complete
        self.groups_due = frozenset(e.groups_due)
        self.group_size = e.group_size
        for node in self.components.values():
            node.steps_done = 0
            node.num_steps = 0
            node.tokens_completed_iter = 0
            node.items_completed_iter = 0
            node.max_tokens_completed = max(node.max_tokens_completed, node.max_tokens_iter)
            node.max_tokens_iter = 0
            if node.lengths_iter:
                node.lengths_prev = sorted(node.lengths_iter)
                node.lengths_prev_suffix = list(
                    itertools.accumulate(reversed(node.lengths_prev), initial=0.0)
                )[::-1]
                node.lengths_prev_suffix_sq = list(
                    itertools.accumulate((n * n for n in reversed(node.lengths_prev)), initial=0.0)
                )[::-1]
                node.lengths_prev_arrays = sorted_arrays(
                    node.lengths_prev, node.lengths_prev_suffix
                )
                node.lengths_iter = []
            if node.group_max_iter:
                node.group_lengths_prev = sorted(node.group_max_iter.values())
                node.group_lengths_prev_suffix = list(
                    itertools.accumulate(reversed(node.group_lengths_prev), initial=0.0)
                )[::-1]
                node.group_lengths_prev_arrays = sorted_arrays(
                    node.group_lengths_prev, node.group_lengths_prev_suffix
                )
                node.group_max_iter = {}
        for edge in self.edges.values():
            edge.enqueued_this_iteration = 0
            edge.groups_done_this_iteration = 0
        for inst in self.instances.values():
            inst.unreported = 0.0  # the last iteration's requests are gone

    def _on_iteration_done(self, e: ev.IterationDone) -> None:
        if e.iteration != self.iteration:
            raise EventError(f"IterationDone({e.iteration}) but iteration {self.iteration} runs")

    def _instance(self, instance: InstanceId) -> Node:
        try:
            return self.instances[instance]
        except KeyError:
            raise EventError(f"unknown instance {instance!r}") from None

    def _release(self, edge: HyperEdge, st: ItemState, time_s: float) -> None:
        """Move an item from its instance back to the edge's queue (for removing an
        instance: see :func:`dynarl.control.item_flow.release`)."""
        item_flow.release(self, edge, st, time_s)

    def _on_engine_stats(self, e: ev.EngineStats) -> None:
        node = self._instance(e.instance)
        if (
            not 0.0 <= e.kv_usage <= 1.0
            or min(e.num_running, e.num_queued, e.kv_tokens, e.decode_steps, e.decode_tokens) < 0
            or not min(e.gen_tokens_per_s, e.decode_s, e.prefill_s, e.resume_prefill_s) >= 0.0
            or e.resume_prefill_s > e.prefill_s * (1.0 + 1e-9)  # (rounding: a sum of parts)
        ):
            raise EventError(f"impossible engine stats from {e.instance!r}: {e}")
        hn = self.components[node.component]
        if e.time_s > node.last_stats_s:
            # Tokens generated since the last report, at the rate of this one, by the
            # requests running over the window (between the two reports' counts).
            tokens = e.gen_tokens_per_s * (e.time_s - node.last_stats_s)
            hn.work_rate.add(e.time_s, tokens)
            # Those that ran in the window: at least the running of either report.
            node.start_oldest(max(node.num_running, e.num_running))
            node.add_tokens(tokens)
        node.start_oldest(e.num_running)
        node.stop_youngest(e.num_running)
        node.kv_usage = e.kv_usage
        node.kv_tokens = e.kv_tokens
        node.num_running = e.num_running
        node.num_queued = e.num_queued
        node.busy = e.num_running + e.num_queued > 0
        node.last_stats_s = e.time_s
        node.gen_tokens_per_s = e.gen_tokens_per_s
        node.decode_steps, node.decode_tokens = e.decode_steps, e.decode_tokens
        node.decode_s, node.prefill_s = e.decode_s, e.prefill_s
        node.resume_prefill_s = e.resume_prefill_s
        if e.kv_usage >= self.u_low:
            node.below_since_s = None
        elif node.below_since_s is None:
            node.below_since_s = e.time_s

    def _on_worker_idle(self, e: ev.WorkerIdle) -> None:
        node = self._instance(e.instance)
        node.busy = False
        node.num_running = node.num_queued = 0

    def _on_steps_held(self, e: ev.StepsHeld) -> None:
        try:
            self.components[e.component].hold_steps = e.held
        except KeyError:
            raise EventError(f"unknown component {e.component!r}") from None

    def _on_train_step_done(self, e: ev.TrainStepDone) -> None:
        try:
            hn = self.components[e.component]
        except KeyError:
            raise EventError(f"unknown component {e.component!r}") from None
        hn.steps_done = e.step + 1
        hn.num_steps = e.num_steps
        hn.work_rate.add(e.time_s, e.num_samples)
        if e.duration_s > 0:
            hn.last_step_samples_per_s = e.num_samples / e.duration_s

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Verify every invariant from scratch; raises :class:`InvariantError`.

        See :func:`dynarl.control.invariants.check_invariants`.
        """
        check_invariants(self)
