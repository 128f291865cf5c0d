"""Errors of worker processes, their lifecycle, typed handles and launchers; all derive
from :class:`dynarl.core.errors.DynaRLError`."""

from typing import TYPE_CHECKING

from dynarl.core.errors import DynaRLError

if TYPE_CHECKING:
    from dynarl.workers.trainer import Recovery


class WorkerError(DynaRLError):
    """Root of the errors of worker processes and their handles."""


class LifecycleError(WorkerError):
    """A worker was asked for something its lifecycle state does not allow (generate
    before it has a role, a transition the state machine forbids); the message names
    the state and what to do first."""


class WorkerCallError(WorkerError):
    """A worker could not carry out a typed call; ``error`` names the exception type it
    raised there, and the message is that exception's message.

    Attributes:
        error: the worker-side exception's type name, e.g. ``"EngineError"``.
    """

    def __init__(self, message: str, *, error: str) -> None:
        super().__init__(message)
        self.error = error


class LaunchError(WorkerError):
    """Worker processes could not be started, or one exited before saying hello; the
    message gives its exit code and what to check."""


class BadRequestError(WorkerError):
    """A backend refused a request as malformed for it (a duplicate id, an empty or
    too-long prompt, partial output without its log-probs); nothing of the call was
    queued. The message names the request and what is wrong."""


class TrainerError(WorkerError):
    """A trainer worker failed a command, died, or did not answer in time.

    Attributes:
        worker: index of the worker that failed, or ``-1`` when none in particular.
    """

    def __init__(self, message: str, *, worker: int = -1) -> None:
        super().__init__(message)
        self.worker = worker


class RankLostError(TrainerError):
    """A trainer worker died (``worker``); the pool rebuilds itself from the survivors
    with ``recover()`` before it takes another command."""


class TrainerRecoveredError(WorkerError):
    """A trainer worker died during a call, and the trainer rebuilt itself from the
    survivors (``recovery`` says how); the call did not happen, except a step that
    ``recovery.step_applied`` says was. Not a :class:`TrainerError`: the trainer works.

    Attributes:
        recovery: the :class:`~dynarl.workers.trainer.Recovery`.
    """

    def __init__(self, message: str, *, recovery: "Recovery") -> None:
        super().__init__(message)
        self.recovery = recovery


class ReshardError(TrainerError):
    """A resize of the trainer failed; the old group is untouched and keeps training.
    Retry the resize, or pick other workers to join."""


class WeightSyncError(TrainerError):
    """Weights could not be sent to (or received from) the engines: the two sides
    disagree about the tensors, or the sending rank is no longer a trainer."""


class WeightManifestError(WeightSyncError):
    """A receiver's model does not fit the weights the trainer describes (names,
    shapes or dtypes differ): every try would fail the same way, so a sync that meets
    it is not retried. The receiver still took the broadcast in (into scratch, its
    model untouched), so the sender and the other members are not left waiting. Build
    the trainer and the engines from the same model config (and tokenizer)."""
