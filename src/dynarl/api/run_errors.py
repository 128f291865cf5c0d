"""How a real run's iteration can end without finishing: stopped on request, or its
trainer lost a rank it could not rebuild without (both raised by
:class:`~dynarl.api.facade.DynaRL`, which re-exports them)."""

from dynarl.core.errors import DynaRLError


class IterationInterruptedError(DynaRLError):
    """The running iteration was stopped by :meth:`DynaRL.request_stop` before it
    finished; it is not in the history and a resumed run runs it again."""


class TrainerRankLostError(DynaRLError):
    """A trainer worker died (or stopped answering) during an iteration and the trainer
    could not rebuild itself from the survivors: no rank survived with the state, a
    worker stopped answering (a hung collective, ended by its timeout), or the backend
    cannot (Megatron with one replica of tp or pp > 1, whose shards die with any of its
    workers; with the distributed optimizer, a rank dead with its buddy, or any member
    without ``actor.megatron.buddy_copies``: the message says which). The run stops; it
    resumes from its last checkpoint."""
