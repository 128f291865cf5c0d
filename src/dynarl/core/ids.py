"""Typed ids for devices, components, instances, items and migrations.

They are plain ``str``/``int`` at run time (cheap to hash, msgpack-friendly) and
distinct types for mypy, so a device id cannot be passed where an instance id is meant.
"""

from typing import Literal, NewType

DeviceId = NewType("DeviceId", int)
"""One accelerator (on CPU: one device slot, a process with fixed torch threads)."""

ComponentId = NewType("ComponentId", str)
"""A logical stage of the pipeline, e.g. ``"rollout"`` or ``"actor"``."""

InstanceId = NewType("InstanceId", str)
"""One worker instance of a component: a rollout engine, an actor DP replica."""

EdgeId = NewType("EdgeId", str)
"""One dataflow between a producer component and its consumers."""

ItemId = NewType("ItemId", str)
"""One item flowing through the pipeline: a request, a trajectory, a sample."""

GroupId = NewType("GroupId", str)
"""The group an item belongs to (a GRPO prompt's G samples share one)."""

MigrationId = NewType("MigrationId", int)
"""One migration of a committed plan."""

ComponentKind = Literal["rollout", "inference", "reward", "actor", "tool"]
"""What a component does; the scheduler treats kinds differently (concave rollout,
linear actor)."""

COMPONENT_KINDS: tuple[ComponentKind, ...] = ("rollout", "inference", "reward", "actor", "tool")
