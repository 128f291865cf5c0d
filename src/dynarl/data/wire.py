"""Wire messages between the controller and its workers: definitions only, no logic.

Every message is a frozen ``msgspec.Struct`` encoded as a msgpack array whose first
element is its tag (the class name). Messages fall in two tagged unions, one per
direction (:data:`AnyToWorker`, :data:`AnyToController`), each decoded by its own
decoder (:mod:`dynarl.data.codec`). A message type carries either one item or a batch,
never both: :class:`Work` / :class:`WorkBatch`, :class:`Done` / :class:`DoneBatch`.

Requests that expect a reply carry ``corr``, a correlation id the sender picks and the
reply echoes (:class:`Ping` / :class:`Pong`). Typed worker handles build on the same
convention: a :class:`Call` carries a request the data plane does not read (the
worker's own msgpack message, see :mod:`dynarl.workers.protocol`) and is answered by
one or more :class:`Reply` frames with its ``corr``, the last with ``more=False``.

:class:`Hello` and :class:`Refused` keep their layout in every protocol version (the
version comes first), so a worker speaking another version is told so in words.
"""

from typing import Final, Literal

import msgspec

from dynarl.control.events import AnyEvent
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId

PROTOCOL_VERSION: Final = 4
"""Version of this module's messages; a worker announcing another one is refused."""

Affinity = Literal["must", "prefer", "none"]
"""Whether an item returns to the instance that served it before: ``must`` (only
there, while it lives), ``prefer`` (there while it lives and has room, otherwise the
least-loaded instance) or ``none`` (the least-loaded instance)."""

ResultStatus = Literal["done", "tool_call", "aborted", "refused"]
"""How a worker hands an item back: finished (``done``); left the engine to run a tool
call and will return for its next turn (``tool_call``); given back unfinished with
its partial output because the controller asked for it (``aborted``); or refused by the
worker, which cannot serve it (``refused``: the payload is the reason, UTF-8; the item
is finished, never routed again, and counted)."""


class Item(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One unit of work for a worker (a request, a trajectory, a sample).

    ``payload`` is opaque to the data plane (the worker's own msgpack, say);
    ``instance`` is the instance that served it before, if any, and ``affinity`` says
    whether it should return there. ``tool_calls`` and ``prefix_tokens`` (completed
    tool calls, reusable KV prefix length) drive the request queue's priority order.
    ``tokens`` is its size (a request's prompt length; 0: unknown), reported to the
    controller's model (:class:`~dynarl.control.events.ItemRef`). ``generated`` is
    the output it already carries when submitted (a partial rollout's carried request:
    its partial output's tokens, every turn's for a session): the router counts it
    with what instances generate (``ItemsEnqueued.generated``, ``ItemCompleted``).
    """

    id: ItemId
    group: GroupId
    edge: EdgeId
    payload: bytes = b""
    affinity: Affinity = "none"
    instance: InstanceId | None = None
    tool_calls: int = 0
    prefix_tokens: int = 0
    tokens: int = 0
    generated: int = 0


class ItemResult(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What a worker hands back for one item.

    ``payload`` is the output (for ``aborted``: the partial output, which replaces the
    item's payload when it is routed again); ``num_tokens`` is the work this instance
    did for it (for rollout, the tokens it generated, not those of a partial output the
    item resumed from: the router adds up every result's); ``prefix_tokens`` the context
    the engine now holds cached for it (its reusable KV prefix).
    """

    item: ItemId
    status: ResultStatus = "done"
    payload: bytes = b""
    num_tokens: int = 0
    prefix_tokens: int = 0


class ToWorker(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Base of the messages the controller sends to a worker."""


class ToController(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Base of the messages a worker sends to the controller."""


# ------------------------------------------------------------ controller -> worker


class Welcome(ToWorker, frozen=True):
    """Hello accepted: the worker is ``instance`` and must answer pings; the controller
    pings every ``heartbeat_interval_s`` and declares it failed after
    ``liveness_timeout_s`` of silence (the worker may do the same the other way)."""

    protocol: int
    instance: InstanceId
    heartbeat_interval_s: float
    liveness_timeout_s: float


class Refused(ToWorker, frozen=True):
    """Hello refused, or a message from a worker the controller no longer knows.
    ``code`` is ``"version"``, ``"auth"`` (a wrong or missing run token),
    ``"duplicate"``, ``"invalid"`` or ``"unknown"``; ``reason`` says what to do."""

    code: str
    reason: str


class Work(ToWorker, frozen=True):
    """One item to serve."""

    item: Item


class WorkBatch(ToWorker, frozen=True):
    """A batch of items to serve."""

    items: tuple[Item, ...]


class Abort(ToWorker, frozen=True):
    """Hand these items back (status ``aborted``, with their partial output) as soon as
    possible: their instance is being drained."""

    items: tuple[ItemId, ...]


class EndSessions(ToWorker, frozen=True):
    """These multi-turn sessions are over (their episodes ended while out on a tool
    call, after a turn this worker served): drop what is kept for them between turns,
    such as their cached KV prefix. A hint; nothing is handed back."""

    items: tuple[ItemId, ...]


class Ping(ToWorker, frozen=True):
    """Liveness probe and round-trip measurement; answered by :class:`Pong`."""

    corr: int


class Retire(ToWorker, frozen=True):
    """The controller is done with this instance; the worker should close its link.
    With ``reconnect`` the worker connects again as the instance it was told to
    become (a role switch); without it, it stops."""

    reason: str
    reconnect: bool = False


class Call(ToWorker, frozen=True):
    """A request to the worker itself (not an item): ``body`` is opaque to the data
    plane; the worker answers with :class:`Reply` frames carrying the same ``corr``."""

    corr: int
    body: bytes


# ------------------------------------------------------------ worker -> controller


class Hello(ToController, frozen=True):
    """First message of a worker: its protocol version, the instance it runs, the
    component it belongs to, how many items it takes at once (``capacity``), the run's
    token (:mod:`dynarl.data.endpoint`; a router that asks for one refuses any other),
    and how many of those it runs at once (``slots``: a rollout engine's batch, the rest
    waiting in its own queue; 0: all of them)."""

    protocol: int
    instance: InstanceId
    component: ComponentId
    capacity: int
    token: str = ""
    slots: int = 0


class Pong(ToController, frozen=True):
    """Answer to :class:`Ping` with the same ``corr``."""

    corr: int


class Done(ToController, frozen=True):
    """One item handed back."""

    result: ItemResult


class DoneBatch(ToController, frozen=True):
    """A batch of items handed back."""

    results: tuple[ItemResult, ...]


class Report(ToController, frozen=True):
    """A control-plane event the worker observed (engine stats, a finished train
    step); the controller stamps its own time on it."""

    event: AnyEvent


class Reply(ToController, frozen=True):
    """One answer to the :class:`Call` with the same ``corr``; ``more`` says whether
    further answers follow (a streamed reply)."""

    corr: int
    body: bytes
    more: bool = False


class Bye(ToController, frozen=True):
    """The worker leaves; the items it still holds are routed elsewhere."""

    reason: str = ""


AnyToWorker = Welcome | Refused | Work | WorkBatch | Abort | EndSessions | Ping | Retire | Call
"""Every message the controller sends to a worker."""

AnyToController = Hello | Pong | Done | DoneBatch | Report | Reply | Bye
"""Every message a worker sends to the controller."""
