"""The trainer role: what an optimizer step takes and reports, what a resize did, and
the loss a trainer runs. Definitions only; no torch is imported (tensor types are for
type checkers).
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

Minibatch = Mapping[str, npt.NDArray[Any]]
"""Named arrays with the samples on dimension 0 (``input_ids``, ``attention_mask``,
and whatever the loss reads, e.g. ``loss_weights``)."""


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
