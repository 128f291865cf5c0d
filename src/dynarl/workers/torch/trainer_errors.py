"""The torch trainer's own error: a fault injected on purpose into a resize. (The
trainer role's errors are :mod:`dynarl.workers.errors`'.)"""

from dynarl.workers.errors import ReshardError


class InjectedFaultError(ReshardError):
    """Raised on purpose by a :class:`~dynarl.workers.torch.trainer_commands.ReshardFault`
    to exercise the failure path of a resize."""
