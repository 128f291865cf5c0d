"""Events: what workers and executors report to the controller.

A tagged union of frozen ``msgspec.Struct``s (the tag is the class name, in field
``"event"``), so events cross process boundaries as msgpack unchanged. Each event is
about one thing; batch forms say so in their name. This module holds definitions only.
"""

import msgspec

from dynarl.control.plan import Migration
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId, MigrationId


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event", tag=True):
    """Base of every event. ``time_s`` is when it happened, on the controller's clock."""

    time_s: float = 0.0


class ItemRef(msgspec.Struct, frozen=True, array_like=True):
    """An item, its group (GRPO: the prompt whose G samples it belongs to) and its size:
    ``tokens`` is the prompt's length for a rollout request and the sequence's (prompt
    plus response) for a sample, which sets what scoring and training it cost; 0 when
    the producer does not know it. Report sizes on every item or on none: the model
    measures the work of the stages after rollout in tokens once any item has a size."""

    id: ItemId
    group: GroupId
    tokens: int = 0


class IterationStarted(Event, frozen=True, kw_only=True):
    """A new RL iteration begins (rollout of a fresh batch of prompts).
    ``groups_to_complete``: with partial rollouts, the rollout ends once every group in
    ``groups_due`` and this many of the others are whole (every request of each
    completed), and its other requests are withdrawn (:class:`ItemsWithdrawn`);
    ``None``: once every request has completed. ``group_size``: samples per group (0:
    not said); with partial rollouts a group's finished samples wait, outside the
    pipeline, until the group is admitted, and this tells the model how many there are.
    """

    iteration: int
    groups_to_complete: int | None = None
    groups_due: tuple[GroupId, ...] = ()
    group_size: int = 0


class IterationDone(Event, frozen=True, kw_only=True):
    """The iteration's last optimizer step and weight sync finished."""

    iteration: int


class ItemsEnqueued(Event, frozen=True, kw_only=True):
    """A producer put a batch of new items on ``edge``; they wait in its queue.
    ``generated``, if given (one count per item, in order), is the tokens each already
    carries: a partial rollout's request carried over from the last iteration resumes
    from its partial output (see :class:`ItemsWithdrawn`)."""

    edge: EdgeId
    items: tuple[ItemRef, ...]
    generated: tuple[int, ...] = ()


class ItemRouted(Event, frozen=True, kw_only=True):
    """The router sent a queued item to ``instance`` (a consumer of ``edge``)."""

    edge: EdgeId
    item: ItemId
    instance: InstanceId


class ItemsRequeued(Event, frozen=True, kw_only=True):
    """Items were taken back from the instances holding them (aborted for a migration)
    and put back in the queue; they keep their partial output. ``generated``, if the
    producer knows it, is the tokens each has generated so far (one per item, in
    order); without it the model keeps its estimate from the engines' reports."""

    edge: EdgeId
    items: tuple[ItemId, ...]
    generated: tuple[int, ...] = ()


class ItemsWithdrawn(Event, frozen=True, kw_only=True):
    """Unfinished items left ``edge`` without completing: a partial rollout's iteration
    ended once it had the groups it trains, and these (queued, or aborted on the
    instance that held them, keeping their partial output) carry over to the next
    iteration, where they are enqueued again. ``generated`` as in
    :class:`ItemsRequeued`."""

    edge: EdgeId
    items: tuple[ItemId, ...]
    generated: tuple[int, ...] = ()


class ItemCompleted(Event, frozen=True, kw_only=True):
    """``instance`` finished ``item`` (a request completed, a sample scored or trained);
    ``num_tokens`` is the work it did (generated tokens for rollout).

    A producer reports the downstream ``ItemsEnqueued`` *before* the upstream
    ``ItemCompleted``, so between two events the pipeline's work never seems to vanish.
    """

    edge: EdgeId
    item: ItemId
    instance: InstanceId
    num_tokens: int = 0


class ToolCallStarted(Event, frozen=True, kw_only=True):
    """A multi-turn request left its engine to run a tool (on CPU, off the devices).

    ``prefix_tokens`` is the context the engine holds for it (its reusable KV prefix).
    """

    edge: EdgeId
    item: ItemId
    instance: InstanceId
    tool: str = ""
    prefix_tokens: int = 0


class ToolCallFinished(Event, frozen=True, kw_only=True):
    """The tool returned; the request waits in the queue for its next turn, preferring
    the engine that holds its prefix."""

    edge: EdgeId
    item: ItemId
    latency_s: float = 0.0
    ok: bool = True


class EngineStats(Event, frozen=True, kw_only=True):
    """A rollout engine's load: KV usage (tokens held / capacity), running and queued
    request counts, its recent generation throughput and, if it says, ``kv_tokens``:
    the tokens of context its running requests hold (SGLang's ``num_used_tokens``; 0
    when the engine does not report it). A decode step reads that KV, so it is what
    the step costs beyond the weights. ``prefill_steps`` and ``decode_steps`` count
    the engine's steps since it started serving as ``instance``, ``prefill_s`` and
    ``decode_s`` the seconds they took and ``decode_tokens`` the tokens its decode
    steps generated (0 where the engine does not count them); ``resume_prefill_s``
    is the part of ``prefill_s`` spent re-prefilling requests resumed with partial
    output (moved here from another engine), which is the move's cost, not the
    workload's."""

    instance: InstanceId
    kv_usage: float
    num_running: int
    num_queued: int
    gen_tokens_per_s: float = 0.0
    kv_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    resume_prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0


class WorkerIdle(Event, frozen=True, kw_only=True):
    """``instance`` has nothing to do."""

    instance: InstanceId


class TrainStepDone(Event, frozen=True, kw_only=True):
    """The actor finished optimizer step ``step`` (0-based) of ``num_steps`` in this
    iteration, over ``num_samples`` samples in ``duration_s``."""

    component: ComponentId
    step: int
    num_steps: int
    num_samples: int
    duration_s: float


class StepsHeld(Event, frozen=True, kw_only=True):
    """The controller holds (``held``) or releases trainer ``component`` at its next
    optimizer-step boundary: while held, it starts no step (devices are on their way
    to it, and the step ends sooner if it waits for them)."""

    component: ComponentId
    held: bool


class MigrationStarted(Event, frozen=True, kw_only=True):
    """The controller committed ``migration``: its source instances start draining and
    its devices are in transit until ``MigrationDone`` or ``MigrationFailed``."""

    migration: Migration


class MigrationDone(Event, frozen=True, kw_only=True):
    """The executor finished the migration; the new instances are active."""

    migration: MigrationId
    duration_s: float = 0.0


class MigrationFailed(Event, frozen=True, kw_only=True):
    """The migration failed; the drained instances keep running where they were."""

    migration: MigrationId
    reason: str


class WorkerFailed(Event, frozen=True, kw_only=True):
    """``instance`` died or stopped answering; its items go back to their queues."""

    instance: InstanceId
    reason: str


AnyEvent = (
    IterationStarted
    | IterationDone
    | ItemsEnqueued
    | ItemRouted
    | ItemsRequeued
    | ItemsWithdrawn
    | ItemCompleted
    | ToolCallStarted
    | ToolCallFinished
    | EngineStats
    | WorkerIdle
    | TrainStepDone
    | StepsHeld
    | MigrationStarted
    | MigrationDone
    | MigrationFailed
    | WorkerFailed
)
"""Every event, as a union msgspec can decode."""
