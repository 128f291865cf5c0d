"""Errors the torch rollout engine and inference worker raise; they derive from
:class:`DynaRLError`. (Weight-transfer errors are
:class:`~dynarl.workers.torch.trainer_errors.WeightSyncError`.)"""

from dynarl.core.errors import DynaRLError


class EngineError(DynaRLError):
    """A rollout engine or inference worker was asked for something it cannot do in its
    current state (an unknown or duplicate request, a prompt longer than the model
    handles, a step while its memory is released). The message says what to do next."""
