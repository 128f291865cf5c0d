"""Typed calls between the controller's worker handles and a worker process (a device
slot): requests in, replies out. Definitions only, no logic, no torch.

They ride the data plane as the opaque body of a :class:`~dynarl.data.wire.Call` and
its :class:`~dynarl.data.wire.Reply` frames (:mod:`dynarl.data.wire` does not know
them), encoded as msgpack tagged unions: :data:`AnySlotRequest` one way,
:data:`AnySlotReply` the other. Every request is answered by one reply, except
:class:`Generate`, answered by a stream of :class:`Generated` replies (the last one
says no more follow). A request the worker cannot carry out is answered by
:class:`Failed`. Weights never ride these messages: they move over torch.distributed.
"""

from typing import Annotated, Final, Literal

import msgspec

from dynarl.core.config import Accelerator
from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data.request_queue import DEFAULT_AGING, AgingBound
from dynarl.workers.config import InferenceConfig, ModelConfig, RolloutConfig
from dynarl.workers.inference import (
    InferenceProgress,
    LogprobRequest,
    LogprobResult,
)
from dynarl.workers.lifecycle import LifecycleState
from dynarl.workers.rollout import Completion, EngineLoad, GenerateRequest
from dynarl.workers.weights import WeightManifest

FREE: Final = ComponentId("free")
"""The component a slot belongs to while it has no role (nothing is routed to it)."""

RoleKind = Literal["rollout", "inference"]
"""The roles a slot can assume."""

# ------------------------------------------------------------------ roles


class RolloutRole(msgspec.Struct, frozen=True, kw_only=True, tag="rollout"):
    """Serve as a rollout engine.

    Attributes:
        model: the policy model (built from ``seed`` when it has no path).
        rollout: the engine's limits.
        order: the request order of the engine's waiting queue (the data plane's
            priority-aware :class:`~dynarl.data.request_queue.RequestQueue`): ``fifo``
            or ``priority`` (more completed tool calls first).
        aging: the queue's starvation bound (``None``: none, for comparisons only).
        max_queued_requests: most requests the engine holds (waiting and preempted).
        seed: initialises the model without a path and draws sampling seeds.
        accelerator: what the slot's device is (``cluster.accelerator``).
        device: the run's device the slot stands for (with ``cuda``: GPU
            ``device % N`` of the ``N`` the process sees).
        devices: the run devices of the instance the engine serves, ``device`` first:
            its tensor-parallel group (a backend that launches a server places it on
            their GPUs). Empty: the ``rollout.tp`` devices from ``device`` on
            (:attr:`engine_devices`).
        server_index: which of the run's launched servers the engine is (it listens
            on ``rollout.sglang.port_base`` plus it): the slot's index for an engine of
            ``rollout.tp``, past every slot's for one of ``rollout.tail_tp``, so a slot
            keeps a server of each size; ``None``: the slot's index.
        component: the component its instances belong to.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    order: Literal["fifo", "priority"] = "fifo"
    aging: AgingBound | None = DEFAULT_AGING
    max_queued_requests: Annotated[int, msgspec.Meta(ge=1)] = 65536
    seed: int = 0
    accelerator: Accelerator = "cpu"
    device: Annotated[int, msgspec.Meta(ge=0)] = 0
    devices: tuple[int, ...] = ()
    server_index: Annotated[int, msgspec.Meta(ge=0)] | None = None
    component: ComponentId = ComponentId("rollout")

    @property
    def engine_devices(self) -> tuple[int, ...]:
        """The run devices the engine runs on: ``devices``, or the ``rollout.tp``
        devices from ``device`` on when none are given."""
        return self.devices or tuple(range(self.device, self.device + self.rollout.tp))

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens the engine holds: ``rollout.kv_capacity_tokens`` per
        ``rollout.tp`` devices (an engine of the tail's size holds as many per device)."""
        return self.rollout.kv_capacity_tokens * len(self.engine_devices) // self.rollout.tp


class InferenceRole(msgspec.Struct, frozen=True, kw_only=True, tag="inference"):
    """Serve as an inference worker (log-probs of finished samples).

    Attributes:
        model: the policy model (built from ``seed`` when it has no path).
        inference: micro-batch size and whether to score a reference model too.
        seed: initialises the model without a path.
        accelerator: what the slot's device is (``cluster.accelerator``).
        device: the run's device the slot stands for (with ``cuda``: GPU
            ``device % N`` of the ``N`` the process sees).
        component: the component its instances belong to.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    seed: int = 0
    accelerator: Accelerator = "cpu"
    device: Annotated[int, msgspec.Meta(ge=0)] = 0
    component: ComponentId = ComponentId("inference")


Role = RolloutRole | InferenceRole
"""A role and its configuration."""

# ------------------------------------------------------------------ requests


class SlotRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of the requests a slot accepts."""


class AssumeRole(SlotRequest, frozen=True, kw_only=True):
    """Take ``role`` (building it, or resuming it if it was built before with the same
    configuration), releasing the memory of the role held so far; afterwards the slot
    reconnects as ``instance``. Refused while the slot holds requests."""

    role: Role
    instance: InstanceId


class Generate(SlotRequest, frozen=True, kw_only=True):
    """Rollout: generate ``requests`` (fresh, or resumed with partial output)."""

    requests: tuple[GenerateRequest, ...]


class AbortRequests(SlotRequest, frozen=True, kw_only=True):
    """Rollout: take these requests out (all when ``None``) with their partial output."""

    request_ids: tuple[str, ...] | None = None


class Score(SlotRequest, frozen=True, kw_only=True):
    """Inference: compute the log-probs of ``requests``."""

    requests: tuple[LogprobRequest, ...]


class ReleaseMemory(SlotRequest, frozen=True, kw_only=True):
    """Free the role's device memory, keeping the process (state ``released``).
    Rollout requests stay queued; without ``host_backup`` the weights must be updated
    again after resuming."""

    host_backup: bool = False


class ResumeMemory(SlotRequest, frozen=True, kw_only=True):
    """Allocate the released memory again (state ``active``)."""


class Drain(SlotRequest, frozen=True, kw_only=True):
    """Take no new work; finish or hand back what is held (state ``draining``)."""


class Reactivate(SlotRequest, frozen=True, kw_only=True):
    """Take new work again after :class:`Drain` (state ``active``)."""


class JoinWeightSync(SlotRequest, frozen=True, kw_only=True):
    """Join the trainer's weight-sync group at ``host:port`` as ``rank`` of
    ``world_size`` (the trainer's sender is rank 0); returns once all joined."""

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float = 120.0
    num_ranks: int = 1


class UpdateWeights(SlotRequest, frozen=True, kw_only=True):
    """Receive the weights the trainer broadcasts over the weight-sync group now, as
    ``manifest`` describes them; answered with their version."""

    manifest: WeightManifest


class LeaveWeightSync(SlotRequest, frozen=True, kw_only=True):
    """Leave the weight-sync group (every member leaves at the same time, after the
    last sync and before a new group is built); answered once left."""


class GetStats(SlotRequest, frozen=True, kw_only=True):
    """Report the slot's state and load."""


class DecodeSample(msgspec.Struct, frozen=True, kw_only=True):
    """One probe point's measured decode rate.

    Attributes:
        engine_devices: devices of the engine measured (its tensor-parallel size).
        load: requests it decoded at once.
        context: mean tokens of context (prompt and output so far) a request held
            over the measured steps.
        throughput: tokens per second the engine generated, all its requests together.
    """

    engine_devices: int
    load: int
    context: float
    throughput: float


class DecodeProbe(msgspec.Struct, frozen=True, kw_only=True):
    """How one engine is probed: every ``(load, prompt)`` of the grid its limits
    allow (:func:`~dynarl.workers.decode_probe.probe_points`), ``new_tokens`` decode
    steps measured at each, prompts drawn with ``seed``."""

    new_tokens: int = 32
    short_prompt: int = 16
    seed: int = 0


class MeasureDecode(SlotRequest, frozen=True, kw_only=True):
    """Measure the decode rate of the slot's rollout engine as ``probe`` says (it
    holds no request; :mod:`dynarl.workers.decode_probe`); answered with the samples."""

    probe: DecodeProbe = DecodeProbe()


AnySlotRequest = (
    AssumeRole
    | Generate
    | AbortRequests
    | Score
    | ReleaseMemory
    | ResumeMemory
    | Drain
    | Reactivate
    | JoinWeightSync
    | UpdateWeights
    | LeaveWeightSync
    | GetStats
    | MeasureDecode
)
"""Every request a slot accepts."""

# ------------------------------------------------------------------ replies


class SlotReply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of a slot's replies."""


class Ack(SlotReply, frozen=True, kw_only=True):
    """Done; the slot is now in ``state``."""

    state: LifecycleState


class RoleAssumed(SlotReply, frozen=True, kw_only=True):
    """The role is built (or resumed); the slot is now in ``state``. With
    ``in_weight_sync`` the slot was in the weight-sync group and its new role took
    over that membership (the group need not be rebuilt for it)."""

    state: LifecycleState
    in_weight_sync: bool = False


class Generated(SlotReply, frozen=True, kw_only=True):
    """Requests of a :class:`Generate` call that finished since the last reply."""

    completions: tuple[Completion, ...]


class Aborted(SlotReply, frozen=True, kw_only=True):
    """The requests taken out, with their partial output and sampling seed."""

    requests: tuple[GenerateRequest, ...]


class Scored(SlotReply, frozen=True, kw_only=True):
    """Log-probs of the samples of a :class:`Score` call, in order."""

    results: tuple[LogprobResult, ...]


class WeightsUpdated(SlotReply, frozen=True, kw_only=True):
    """The weights arrived; they carry ``version``."""

    version: int


class SlotStats(SlotReply, frozen=True, kw_only=True):
    """A slot's state and load.

    Attributes:
        state: its lifecycle state.
        role: the role it holds (``None`` before the first).
        instance: the instance it is connected as.
        pid: its process id.
        weight_version: version of its role's weights (``None`` without a role).
        load: the rollout engine's load (rollout only).
        progress: samples scored and waiting (inference only).
    """

    state: LifecycleState
    role: RoleKind | None
    instance: InstanceId
    pid: int
    weight_version: int | None = None
    load: EngineLoad | None = None
    progress: InferenceProgress | None = None


class DecodeMeasured(SlotReply, frozen=True, kw_only=True):
    """What a :class:`MeasureDecode` measured, a sample per probe point."""

    samples: tuple[DecodeSample, ...]


class Failed(SlotReply, frozen=True, kw_only=True):
    """The request raised ``error`` (the exception's type name) with ``message``."""

    error: str
    message: str


AnySlotReply = (
    Ack
    | RoleAssumed
    | Generated
    | Aborted
    | Scored
    | WeightsUpdated
    | SlotStats
    | DecodeMeasured
    | Failed
)
"""Every reply a slot sends."""
