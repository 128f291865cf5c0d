"""The error hierarchy: every error dynarl raises derives from :class:`DynaRLError`."""

from collections.abc import Iterator


class DynaRLError(Exception):
    """Root of every error dynarl raises on purpose."""


class ConfigError(DynaRLError, ValueError):
    """A configuration value is invalid; the message names the field and the fix.

    Attributes:
        field: dotted path of the offending field (``"scheduler.u_low"``), or ``""``.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvariantError(DynaRLError, AssertionError):
    """The hypergraph's model of the pipeline broke one of its invariants.

    This is a bug (in dynarl or in a worker reporting impossible events), never a user
    error; the message says which invariant and which ids.
    """


class EventError(DynaRLError):
    """An event refers to something the hypergraph does not know (an unknown instance,
    an item that is not where the event says it is). The event is rejected whole."""


class PlanError(DynaRLError):
    """A plan cannot be applied: it moves a device twice, or one that is not where the
    plan says it is."""


def in_words(error: BaseException) -> str:
    """``error`` in one line for a log: an exception group's leaves (the errors its
    tasks raised), each as ``Type: first line of its message``."""
    return "; ".join(
        f"{type(leaf).__name__}: {next(iter(str(leaf).splitlines()), '')}"
        for leaf in _leaves(error)
    )


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error
