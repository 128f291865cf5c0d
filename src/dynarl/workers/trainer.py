"""The trainer role: what an optimizer step takes and reports, what a resize did, the
loss a trainer runs, and the :class:`Trainer` protocol every trainer backend
implements. Definitions only; no torch is imported (tensor types are for type
checkers).
"""

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec
import numpy.typing as npt

from dynarl.core.ids import InstanceId
from dynarl.workers.weights import WeightManifest, WeightSyncGroup

if TYPE_CHECKING:
    import torch

Minibatch = Mapping[str, npt.NDArray[Any]]
"""Named arrays with the samples on dimension 0 (``input_ids``, ``attention_mask``,
and whatever the loss reads, e.g. ``loss_weights``)."""


class Array(msgspec.Struct, frozen=True, kw_only=True):
    """A dense array on the wire: numpy/torch dtype name, shape and C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class SampleRow(msgspec.Struct, frozen=True, kw_only=True):
    """One sample of a minibatch: its row of every field (the payload of an item on
    the actor's edge, which the data router delivers to the rank that trains it)."""

    fields: dict[str, Array]


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What one optimizer step reports (identical on every rank).

    Attributes:
        loss: global loss, summed over ranks and divided by the global normaliser.
        normaliser: global normaliser (e.g. loss tokens in the minibatch).
        grad_norm: global gradient norm before clipping.
        num_steps: optimizer steps this trainer has taken, this one included.
    """

    loss: float
    normaliser: float
    grad_norm: float
    num_steps: int


class ResizeResult(msgspec.Struct, frozen=True, kw_only=True):
    """A committed resize.

    Attributes:
        epoch: the resize's number in this pool.
        old_members, new_members: workers (world ranks) in data-parallel rank order.
        elapsed_s: wall time of prepare + commit, seen from the pool.
        bytes_moved: bytes the source broadcast to the joiners.
    """

    epoch: int
    old_members: tuple[int, ...]
    new_members: tuple[int, ...]
    elapsed_s: float
    bytes_moved: int


class Recovery(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer rebuilt around lost workers.

    Attributes:
        lost: the workers that died.
        members: the surviving ranks, in data-parallel order.
        source: the survivor whose state every rank continues from.
        num_steps: optimizer steps in that state.
        step_applied: whether the step the loss interrupted (the last one begun) is
            in that state; if not, re-run it.
        last_step: the metrics of the source's last applied step.
        elapsed_s: wall time of the rebuild, seen from the pool.
        bytes_moved: bytes the source sent to the other ranks.
    """

    lost: tuple[int, ...]
    members: tuple[int, ...]
    source: int
    num_steps: int
    step_applied: bool
    last_step: StepMetrics | None
    elapsed_s: float
    bytes_moved: int


class LossOutput(NamedTuple):
    """What a loss returns for one micro-batch.

    Attributes:
        loss_sum: scalar tensor, summed (not averaged) over the micro-batch; gradients
            flow from it.
        normaliser: scalar tensor (or number) this micro-batch adds to the global count
            the summed loss is divided by.
    """

    loss_sum: "torch.Tensor"
    normaliser: "torch.Tensor | float"


class LossFn(Protocol):
    """A training loss; must be picklable (a module-level function or a struct-like
    object) because it is sent to the worker processes once at start."""

    def __call__(
        self, logits: "torch.Tensor", micro_batch: Mapping[str, "torch.Tensor"]
    ) -> LossOutput:
        """Loss sum and normaliser of ``micro_batch`` given the model's ``logits``
        (``[batch, seq, vocab]``)."""
        ...


class Trainer(Protocol):
    """The actor, as the run drives it: an elastic group of trainer ranks over a fixed
    set of pre-started workers (worker ``i`` stands on the ``i``-th device the actor
    may use). The contract every trainer backend implements.

    Calls run one at a time. Between two optimizer steps the trainer is at a migration
    boundary: :meth:`between_steps` holds it there (no step or sync runs meanwhile)
    while the caller resizes it, parks it or saves it.
    """

    @property
    def num_workers(self) -> int:
        """The workers it was started with."""
        ...

    @property
    def members(self) -> tuple[int, ...]:
        """Workers that are trainer ranks now, in data-parallel rank order (none while
        parked)."""
        ...

    @property
    def parked(self) -> bool:
        """Whether it holds no devices (its state kept by one worker)."""
        ...

    @property
    def dead(self) -> frozenset[int]:
        """Workers whose process died (the trainer went on without them) and that
        were not admitted back (:meth:`admit`)."""
        ...

    async def start(self, members: tuple[int, ...]) -> None:
        """Start every worker, then make ``members`` the ranks, with fresh weights."""
        ...

    async def admit(self, workers: tuple[int, ...]) -> None:
        """Take back dead ``workers`` whose processes the launcher started again under
        the same names, at a step boundary: they join the trainer's world holding no
        state; :meth:`resize` may then make them ranks (the state comes peer to
        peer). The ranks and their state do not change."""
        ...

    async def aclose(self) -> None:
        """Stop every worker; idempotent, and finishes even when cancelled."""
        ...

    def between_steps(self) -> AbstractAsyncContextManager[None]:
        """Hold the trainer between two optimizer steps; inside, this task may call
        :meth:`resize`, :meth:`park`, :meth:`save_checkpoint` and
        :meth:`load_checkpoint` (others wait)."""
        ...

    def rank_instances(self) -> list[InstanceId]:
        """The data router's instance of each rank, in data-parallel order: a step's
        samples are routed to them, each to the rank whose shard holds it (see
        :mod:`dynarl.workers.trainer_items`)."""
        ...

    async def train_step(self, shards: Sequence[Sequence[str]]) -> StepMetrics:
        """One optimizer step on the samples the data router delivered to the ranks:
        ``shards[r]`` are rank ``r``'s item ids, in order. The ranks complete the
        items (the router reports them done) as the step ends.

        If a rank dies meanwhile, a trainer that can rebuilds itself from the
        survivors and raises :class:`~dynarl.workers.errors.TrainerRecoveredError`
        (the items not completed stay with the ranks holding them: re-run the step
        on them, or :meth:`finish_step` if the recovery found it applied)."""
        ...

    async def finish_step(self, shards: Sequence[Sequence[str]]) -> None:
        """Complete the samples of a step a recovery found applied, without training:
        ``shards[r]`` are rank ``r``'s item ids."""
        ...

    async def resize(self, members: tuple[int, ...]) -> ResizeResult:
        """Make ``members`` the ranks (create-before-destroy; from a parked trainer,
        its keeper is the source). On failure the old ranks keep training and
        :class:`~dynarl.workers.errors.ReshardError` is raised."""
        ...

    async def park(self) -> ResizeResult:
        """Give up every device, keeping the state with one worker."""
        ...

    async def save_checkpoint(self, path: str) -> None:
        """Write the model and optimizer state to ``path`` (atomically)."""
        ...

    async def load_checkpoint(self, path: str) -> None:
        """Make every rank continue from the state :meth:`save_checkpoint` wrote."""
        ...

    @property
    def weight_sync_ready(self) -> bool:
        """Whether the sender of the weight-sync group is still the trainer's rank 0."""
        ...

    async def host_weight_sync(self, host: str, world_size: int, timeout_s: float) -> int:
        """Make rank 0 open the store of a weight-sync group of ``world_size`` on a
        port of ``host`` the operating system picks, and return that port (the group
        is then joined at it, see :meth:`join_weight_sync`)."""
        ...

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Make rank 0 the sender (group rank 0, hosting the store
        :meth:`host_weight_sync` opened) of ``group``; the engines join at the same
        time."""
        ...

    async def weight_manifest(self, version: int) -> WeightManifest:
        """What :meth:`send_weights` of ``version`` will broadcast, bucket by bucket
        (names, dtypes, shapes), for the engines to be handed before it starts."""
        ...

    async def send_weights(self, version: int) -> int:
        """Broadcast the weights tagged ``version`` to the group, exactly as
        :meth:`weight_manifest` described them; returns bytes sent."""
        ...

    async def leave_weight_sync(self) -> None:
        """The sender leaves the group (after the last sync; the engines leave at
        the same time); a no-op without one."""
        ...
