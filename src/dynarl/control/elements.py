"""The parts of the hypergraph: items on hyperedges, worker nodes, component
hypernodes and dataflow hyperedges. :mod:`dynarl.control.hypergraph` keeps them
current; the scheduler reads them."""

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.control.meter import RateMeter
from dynarl.control.plan import InstanceSpec
from dynarl.control.topology import ComponentSpec, EdgeSpec
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId

TOOL = InstanceId("<tool>")
"""Owner of an item while it is out of its engine running a tool call."""

FloatArray = npt.NDArray[np.float64]
_NO_LENGTHS: tuple[FloatArray, FloatArray] = (np.empty(0), np.zeros(1))


def sorted_arrays(
    lengths: Sequence[float], suffix: Sequence[float]
) -> tuple[FloatArray, FloatArray]:
    """Sorted lengths and their suffix sums (one more, the last 0) as float arrays."""
    return np.asarray(lengths, dtype=np.float64), np.asarray(suffix, dtype=np.float64)


InstanceState = Literal["active", "draining"]


class ItemState:
    """One item on a hyperedge: who holds it, its affinity history and, for a rollout
    request, the tokens it has generated (``generated``, plus what it gained on its
    owner since ``mark`` while ``running``; see :meth:`Node.progress_of`)."""

    __slots__ = (
        "enqueued_s",
        "generated",
        "group",
        "id",
        "last_instance",
        "mark",
        "owner",
        "prefix_tokens",
        "running",
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
        self.generated = 0.0
        self.mark = 0.0
        self.running = False


class Node:
    """One worker instance and its last reported load.

    A rollout engine also keeps ``tokens_per_request``: the tokens one running request
    has gained on it, summed over its stats reports (each report's tokens over the
    requests running). Requests start in the order they were routed (engines admit
    first come, first served), so a report of ``n`` running marks the ``n`` oldest as
    running; each remembers the counter then (``ItemState.mark``). So every request's
    progress is known without a report per request -- the finish of a rollout depends
    on which requests are far from done, not on their mean -- and the sum over the
    requests is the tokens the engine reported.
    """

    __slots__ = (
        "below_since_s",
        "busy",
        "component",
        "decode_s",
        "decode_steps",
        "decode_tokens",
        "devices",
        "gen_tokens_per_s",
        "held_since_s",
        "id",
        "items",
        "kv_tokens",
        "kv_usage",
        "last_stats_s",
        "num_queued",
        "num_running",
        "prefill_s",
        "progress_base",
        "resume_prefill_s",
        "started",
        "state",
        "tokens_per_request",
        "unreported",
        "version",
        "waiting",
    )

    def __init__(self, spec: InstanceSpec, component: ComponentId, now_s: float) -> None:
        self.id = spec.id
        self.component = component
        self.devices = spec.devices
        self.state: InstanceState = "active"
        self.items: dict[ItemId, EdgeId] = {}
        self.kv_usage = 0.0
        self.kv_tokens = 0
        self.num_running = 0
        self.num_queued = 0
        self.gen_tokens_per_s = 0.0
        # The engine's step counters, as last reported: decode steps, the tokens they
        # generated, and the seconds they and its prefills took (0 where the engine
        # does not count them), of which re-prefilling requests moved to it.
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.resume_prefill_s = 0.0
        # The last stats report (its creation before any: an engine's first report
        # covers its time since it started).
        self.last_stats_s = now_s
        self.busy = False
        # Since when it has held at least one item (None while it holds none).
        self.held_since_s: float | None = None
        # Since when KV usage has stayed below the hypergraph's low-usage threshold.
        self.below_since_s: float | None = now_s
        self.tokens_per_request = 0.0
        # Items held and running, in the order they started, and those waiting, in
        # the order they will start (routed, or preempted: these first).
        self.started: dict[ItemId, ItemState] = {}
        self.waiting: dict[ItemId, ItemState] = {}
        # generated (- mark, if running) summed over its items (see progress_sum).
        self.progress_base = 0.0
        # Tokens of requests that completed here beyond their estimate: generated since
        # the last report, so the next reports count them, but they are nobody's now.
        self.unreported = 0.0
        # Counts the changes to which requests it holds and which of them run (not
        # their progress, which ``tokens_per_request`` gives): what is computed from
        # its requests' states holds while it stays.
        self.version = 0

    def attach(self, st: ItemState) -> None:
        """Hold ``st`` (routed here); it waits until a report says it runs."""
        st.running = False
        self.waiting[st.id] = st
        self.progress_base += st.generated
        self.version += 1

    def start_oldest(self, num_running: int) -> None:
        """Mark the first waiting items running, until ``num_running`` are."""
        while len(self.started) < num_running and self.waiting:
            st = self.waiting.pop(next(iter(self.waiting)))
            st.running, st.mark = True, self.tokens_per_request
            self.started[st.id] = st
            self.progress_base -= st.mark
            self.version += 1

    def stop_youngest(self, num_running: int) -> None:
        """Mark the youngest running items preempted, until ``num_running`` run (an
        engine short of KV retracts its youngest requests; they resume first)."""
        stopped: dict[ItemId, ItemState] = {}
        while len(self.started) > num_running:
            _, st = self.started.popitem()
            self._fold(st)
            stopped[st.id] = st
        if stopped:
            self.waiting = dict(reversed(stopped.items())) | self.waiting
            self.version += 1

    def add_tokens(self, tokens: float) -> None:
        """The engine generated ``tokens`` more: its running items share them, less
        what requests that have completed since generated (:meth:`settle`)."""
        owed = min(tokens, self.unreported) if self.unreported > 0 else self.unreported
        self.unreported -= owed
        if self.started:
            self.tokens_per_request += (tokens - owed) / len(self.started)

    def settle(self, st: ItemState, generated: float) -> None:
        """``st`` completed here having generated ``generated`` tokens in all: what
        that differs from its estimate is not the remaining requests' progress."""
        self.unreported += generated - self.progress_of(st)

    def detach(self, st: ItemState) -> None:
        """Fold the progress ``st`` made here into ``st.generated`` (it leaves)."""
        if st.running:
            del self.started[st.id]
            self._fold(st)
        else:
            del self.waiting[st.id]
        self.progress_base -= st.generated
        self.version += 1

    def _fold(self, st: ItemState) -> None:
        """Stop counting ``st`` as running: its progress so far goes into ``generated``
        (``progress_base`` then counts it as a waiting item)."""
        self.progress_base += self.tokens_per_request
        st.generated += self.tokens_per_request - st.mark
        st.running, st.mark = False, 0.0

    def progress_of(self, st: ItemState) -> float:
        """Tokens ``st`` (held here) has generated, as of the last stats report."""
        if st.running:
            return st.generated + self.tokens_per_request - st.mark
        return st.generated

    def context_of(self, st: ItemState) -> float:
        """Tokens of context ``st`` (held here) holds: its prompt and what it has
        generated, or its session's cached prefix if that is longer (what re-prefilling
        it elsewhere recomputes)."""
        return max(st.tokens + self.progress_of(st), st.prefix_tokens)

    def progress_sum(self) -> float:
        """Tokens the items it holds have generated in all."""
        return self.progress_base + len(self.started) * self.tokens_per_request


class HyperNode:
    """One component: its spec, its instances and measured rates.

    ``spec`` is the component's spec at its instances' current size: ``base_spec`` as
    built, or (after :meth:`resize`) with ``devices_per_instance`` set to the other
    size the spec allows (``tail_devices_per_instance``).
    """

    def __init__(self, spec: ComponentSpec, *, rate_tau_s: float) -> None:
        self.base_spec = spec
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
        self.lengths_prev_suffix_sq: list[float] = []  # suffix sums of squares
        # Rollout: each group's longest response this iteration, and the last finished
        # iteration's group maxima (sorted, with suffix sums): when a group completes.
        self.group_max_iter: dict[GroupId, int] = {}
        self.group_lengths_prev: list[int] = []
        self.group_lengths_prev_suffix: list[float] = []
        # The same two sorted lengths with their suffix sums, as arrays (for the models
        # that read every pending request at once: dynarl.control.partial_cut).
        self.lengths_prev_arrays: tuple[FloatArray, FloatArray] = _NO_LENGTHS
        self.group_lengths_prev_arrays: tuple[FloatArray, FloatArray] = _NO_LENGTHS
        # This iteration only: tokens and requests completed.
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
        # Rollout, multi-turn sessions: of the sessions that went out on a tool call
        # after their k-th turn (index k), how many came back for another turn and how
        # many their environment ended there (see rollout_lengths.returning_sessions).
        self.tool_returns: list[int] = []
        self.tool_ends: list[int] = []

    @property
    def id(self) -> ComponentId:
        """The component's id."""
        return self.spec.id

    def resize(self, devices_per_instance: int) -> None:
        """Set the devices every instance runs on from now: one of
        ``base_spec.instance_sizes`` (the caller makes sure no active instance of
        another size is left). Raises :class:`ValueError` for another size."""
        if devices_per_instance not in self.base_spec.instance_sizes:
            raise ValueError(
                f"{self.id} instances run on {self.base_spec.instance_sizes} devices, "
                f"not {devices_per_instance}"
            )
        if devices_per_instance == self.base_spec.devices_per_instance:
            self.spec = self.base_spec
        elif devices_per_instance != self.spec.devices_per_instance:
            self.spec = msgspec.structs.replace(
                self.base_spec, devices_per_instance=devices_per_instance
            )

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

    @property
    def steps_left(self) -> int:
        """A trainer's optimizer steps not yet done this iteration (its steps as its
        workers last reported them, else its spec's)."""
        return (self.num_steps or self.spec.steps_per_iteration) - self.steps_done


class HyperEdge:
    """One dataflow: its items, its queue (insertion-ordered) and progress counters."""

    def __init__(self, spec: EdgeSpec) -> None:
        self.spec = spec
        self.items: dict[ItemId, ItemState] = {}
        self.queue: dict[ItemId, None] = {}
        # Sessions out on a tool call, and their counts by the turns they have done (>= 1).
        self.in_tool: dict[ItemId, ItemState] = {}
        self.in_tool_turns: dict[int, int] = {}
        # Pending items per group: [count, sizes (ItemRef.tokens, 1 at least)].
        self.groups: dict[GroupId, list[int]] = {}
        self.num_enqueued = 0
        self.enqueued_this_iteration = 0
        self.groups_done_this_iteration = 0  # groups (not due ones) now complete
        self.num_routed = 0
        self.num_requeued = 0
        self.num_withdrawn = 0
        self.num_completed = 0
        self.tokens_completed = 0
        self.tokens_pending = 0  # sizes (ItemRef.tokens, 1 at least) of its pending items
        # Tokens generated by its pending items that no instance holds (queued, in a tool).
        self.progress_parked = 0.0

    @property
    def id(self) -> EdgeId:
        """The edge's id."""
        return self.spec.id

    @property
    def num_in_tool(self) -> int:
        """Sessions out on a tool call."""
        return len(self.in_tool)

    @property
    def num_pending(self) -> int:
        """Items not yet completed (queued, in flight or in a tool call)."""
        return len(self.items)
