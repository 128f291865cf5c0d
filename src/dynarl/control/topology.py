"""The static shape of a pipeline: its components and dataflows.

A :class:`PipelineSpec` is what the hypergraph's static facts are built from. The
standard RL pipelines (math: rollout -> reward + inference -> actor; agentic: the same
with tool calls inside rollout) come from :func:`rl_pipeline`.
"""

from collections.abc import Sequence
from typing import Literal

import msgspec

from dynarl.core.errors import ConfigError
from dynarl.core.ids import ComponentId, ComponentKind, EdgeId

InterruptPoint = Literal["request", "micro_batch", "optimizer_step", "never"]
"""Where a component can be interrupted to migrate."""

Scaling = Literal["concave", "linear"]
"""How a component's throughput grows with devices: ``concave`` (rollout: marginal
value falls as requests finish) or ``linear`` (trainer, inference)."""


class ComponentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Static facts of one component (a hypernode).

    ``devices_per_instance`` is the scaling unit (rollout TP; actor TP x PP).
    ``tail_devices_per_instance`` is the other size a component's instances may all be
    regrouped into (the rollout's engines for its tail: a larger TP; 0: none); see
    :meth:`~dynarl.control.elements.HyperNode.resize`.
    ``valid_sizes`` restricts the number of instances (actor data-parallel sizes that
    divide the global batch); empty means any count in ``[min_instances,
    max_instances]``. ``max_load_per_instance`` is how many requests one instance runs
    at once (a rollout engine's max running requests; 0: unbounded). A component with
    ``devices_per_instance == 0`` runs off the devices (a rule-based reward, a tool
    sandbox) and never takes part in migrations. ``steps_per_iteration`` is how many
    chunks the iteration's work is processed in (the actor's ``n_minibatches``);
    ``steps_in_arrival_order`` says each chunk takes the next items in the order they
    arrive (streamed minibatches: the last holds the longest responses), else every
    chunk draws evenly from the iteration's items.
    """

    id: ComponentId
    kind: ComponentKind
    devices_per_instance: int = 1
    interruptible_at: InterruptPoint = "request"
    scaling: Scaling = "linear"
    min_instances: int = 0
    max_instances: int = 1 << 30
    valid_sizes: tuple[int, ...] = ()
    max_load_per_instance: int = 0
    steps_per_iteration: int = 1
    steps_in_arrival_order: bool = False
    tail_devices_per_instance: int = 0

    @property
    def instance_sizes(self) -> tuple[int, ...]:
        """The devices an instance may run on: the unit, then the tail's size if any."""
        tail = self.tail_devices_per_instance
        return (self.devices_per_instance, tail) if tail else (self.devices_per_instance,)

    def is_valid_size(self, num_instances: int) -> bool:
        """Whether the component may run with ``num_instances`` instances."""
        if not self.min_instances <= num_instances <= self.max_instances:
            return False
        return not self.valid_sizes or num_instances in self.valid_sizes or num_instances == 0

    @property
    def on_devices(self) -> bool:
        """Whether the component occupies devices at all."""
        return self.devices_per_instance > 0


class EdgeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One dataflow: ``producer`` (``None`` for the prompt source) feeds ``consumers``.

    Every item on the edge is held by exactly one consumer instance, or waits in the
    edge's queue.
    """

    id: EdgeId
    producer: ComponentId | None
    consumers: tuple[ComponentId, ...]


class PipelineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Components and dataflows of one pipeline."""

    components: tuple[ComponentSpec, ...]
    edges: tuple[EdgeSpec, ...]

    def __post_init__(self) -> None:
        ids = [c.id for c in self.components]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"pipeline has duplicate component ids: {ids}")
        known = set(ids)
        for edge in self.edges:
            for end in (edge.producer, *edge.consumers):
                if end is not None and end not in known:
                    raise ConfigError(
                        f"edge {edge.id!r} names unknown component {end!r}; "
                        f"known components: {sorted(known)}"
                    )
            if not edge.consumers:
                raise ConfigError(f"edge {edge.id!r} has no consumers")

    def component(self, cid: ComponentId) -> ComponentSpec:
        """The spec of component ``cid``."""
        for c in self.components:
            if c.id == cid:
                return c
        raise KeyError(cid)

    def predecessors(self, cid: ComponentId) -> tuple[ComponentId, ...]:
        """Components feeding ``cid``."""
        return tuple(
            e.producer for e in self.edges if cid in e.consumers and e.producer is not None
        )

    def ancestors(self, cid: ComponentId) -> set[ComponentId]:
        """Components feeding ``cid``, directly or through others."""
        seen: set[ComponentId] = set()
        stack = list(self.predecessors(cid))
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                stack.extend(self.predecessors(c))
        return seen

    def successors(self, cid: ComponentId) -> tuple[ComponentId, ...]:
        """Components ``cid`` feeds."""
        return tuple(c for e in self.edges if e.producer == cid for c in e.consumers)

    def stage_order(self) -> tuple[ComponentId, ...]:
        """Components on devices in dataflow order (a topological order)."""
        order: list[ComponentId] = []
        seen: set[ComponentId] = set()

        def visit(cid: ComponentId) -> None:
            if cid in seen:
                return
            seen.add(cid)
            for p in self.predecessors(cid):
                visit(p)
            order.append(cid)

        for c in self.components:
            visit(c.id)
        return tuple(c for c in order if self.component(c).on_devices)


ROLLOUT = ComponentId("rollout")
INFERENCE = ComponentId("inference")
REWARD = ComponentId("reward")
ACTOR = ComponentId("actor")

PROMPTS = EdgeId("prompts")
TO_REWARD = EdgeId("to_reward")
TO_INFERENCE = EdgeId("to_inference")
TO_ACTOR = EdgeId("to_actor")


def valid_dp_sizes(
    samples_per_minibatch: int, max_dp: int, *, allow_uneven: bool = False
) -> tuple[int, ...]:
    """Data-parallel sizes the trainer may take: those dividing the minibatch evenly.

    With ``allow_uneven`` (ranks take uneven micro-batch counts) every size up to the
    minibatch size is valid.
    """
    if samples_per_minibatch < 1 or max_dp < 1:
        return ()
    limit = min(max_dp, samples_per_minibatch)
    if allow_uneven:
        return tuple(range(1, limit + 1))
    return tuple(n for n in range(1, limit + 1) if samples_per_minibatch % n == 0)


def rl_pipeline(
    *,
    rollout_tp: int,
    inference_tp: int,
    rollout_tail_tp: int = 0,
    actor_devices_per_replica: int,
    actor_dp_sizes: Sequence[int],
    reward_on_devices: bool = False,
    rollout_max_running: int = 0,
    actor_steps_per_iteration: int = 1,
    actor_steps_in_arrival_order: bool = False,
    with_inference: bool = True,
) -> PipelineSpec:
    """The standard RL pipeline: prompts -> rollout -> (reward, inference) -> actor.

    Reward runs off the devices unless ``reward_on_devices`` (a reward model).
    ``rollout_tail_tp``: the engine size the rollout's tail may regroup into (0: none).
    ``actor_steps_in_arrival_order``: minibatches are formed as samples arrive.
    Without ``with_inference`` (the actor trains on the engines' own log-probs) there
    is no inference stage: rollout feeds the actor.
    """
    components: tuple[ComponentSpec, ...] = (
        ComponentSpec(
            id=ROLLOUT,
            kind="rollout",
            devices_per_instance=rollout_tp,
            interruptible_at="request",
            scaling="concave",
            max_load_per_instance=rollout_max_running,
            tail_devices_per_instance=rollout_tail_tp,
        ),
        ComponentSpec(
            id=INFERENCE,
            kind="inference",
            devices_per_instance=inference_tp,
            interruptible_at="micro_batch",
            scaling="linear",
        ),
        ComponentSpec(
            id=REWARD,
            kind="reward",
            devices_per_instance=1 if reward_on_devices else 0,
            interruptible_at="micro_batch",
            scaling="linear",
        ),
        ComponentSpec(
            id=ACTOR,
            kind="actor",
            devices_per_instance=actor_devices_per_replica,
            interruptible_at="optimizer_step",
            scaling="linear",
            valid_sizes=tuple(actor_dp_sizes),
            steps_per_iteration=actor_steps_per_iteration,
            steps_in_arrival_order=actor_steps_in_arrival_order,
        ),
    )
    edges: tuple[EdgeSpec, ...] = (
        EdgeSpec(id=PROMPTS, producer=None, consumers=(ROLLOUT,)),
        EdgeSpec(id=TO_REWARD, producer=ROLLOUT, consumers=(REWARD,)),
        EdgeSpec(id=TO_INFERENCE, producer=ROLLOUT, consumers=(INFERENCE,)),
        EdgeSpec(id=TO_ACTOR, producer=INFERENCE, consumers=(ACTOR,)),
    )
    if not with_inference:
        components = tuple(c for c in components if c.id != INFERENCE)
        edges = (*edges[:2], EdgeSpec(id=TO_ACTOR, producer=ROLLOUT, consumers=(ACTOR,)))
    return PipelineSpec(components=components, edges=edges)
