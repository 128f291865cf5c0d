"""Errors of the elastic trainer, its resizes and its weight sync."""

from dynarl.core.errors import DynaRLError


class TrainerError(DynaRLError):
    """A trainer worker failed a command, died, or did not answer in time.

    Attributes:
        worker: index of the worker that failed, or ``-1`` when none in particular.
    """

    def __init__(self, message: str, *, worker: int = -1) -> None:
        super().__init__(message)
        self.worker = worker


class ReshardError(TrainerError):
    """A resize of the data-parallel group failed; the old group is untouched and keeps
    training. Retry the resize, or pick other workers to join."""


class InjectedFaultError(ReshardError):
    """Raised on purpose by a :class:`~dynarl.workers.torch.trainer_commands.ReshardFault`
    to exercise the failure path of a resize."""


class WeightSyncError(TrainerError):
    """Weights could not be sent to (or received from) the rollout engines: the two
    sides disagree about the tensors, or the sending rank is no longer a trainer."""
