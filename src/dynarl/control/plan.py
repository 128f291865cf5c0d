"""Plans: the scheduler's output, as data.

A :class:`Plan` is a set of :class:`Migration`s; each moves whole instances' devices
from one component (or the free pool) to another (or the free pool), by one of three
mechanisms (:data:`MigrationKind`). Plans carry no behaviour: an executor (real or
simulated) carries them out and reports ``MigrationDone`` / ``MigrationFailed``.
"""

from typing import Literal

import msgspec

from dynarl.core.ids import ComponentId, DeviceId, InstanceId, ItemId, MigrationId

MigrationKind = Literal["workload", "reshard", "reboot"]
"""How devices move: ``workload`` pauses instances and re-routes their requests
(rollout, inference, reward); ``reshard`` moves trainer state peer to peer,
create-before-destroy; ``reboot`` saves, stops and restarts (fallback, recovery)."""


class InstanceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An instance to create: its id and the devices it runs on."""

    id: InstanceId
    devices: tuple[DeviceId, ...]


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """Move ``devices`` from ``src`` to ``dst``.

    ``drain`` lists the ``src`` instances released (all their devices are in
    ``devices``); devices in ``devices`` not held by a drained instance come from the
    free pool. ``create`` lists the ``dst`` instances started on a subset of
    ``devices``; the rest go to the free pool. ``reassign`` is the instance-level
    decision of where the drained instances' items go (largest groups first to the
    least loaded); items that finished meanwhile are skipped by the executor.

    ``unit`` resizes ``dst``: its instances run on that many devices from this
    migration on (one of its spec's ``instance_sizes``; 0: its current size). A resize
    drains every active instance of ``dst`` (they are all one size); see
    :meth:`~dynarl.control.elements.HyperNode.resize`.
    """

    id: MigrationId
    kind: MigrationKind
    src: ComponentId | None
    dst: ComponentId | None
    devices: tuple[DeviceId, ...]
    drain: tuple[InstanceId, ...] = ()
    create: tuple[InstanceSpec, ...] = ()
    reassign: tuple[tuple[ItemId, InstanceId], ...] = ()
    unit: int = 0


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler decided for one trigger.

    ``score_before`` and ``score_after`` are the predictor's figures of merit for
    keeping the placement and for this plan (predicted remaining iteration seconds:
    lower is better); ``reason`` says which policy produced it and why, for logs and
    the timeline.
    """

    migrations: tuple[Migration, ...] = ()
    reason: str = ""
    score_before: float = 0.0
    score_after: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.migrations)


EMPTY_PLAN = Plan()
