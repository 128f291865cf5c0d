"""How an error reads in a one-line log (:func:`dynarl.core.errors.in_words`): a task
group's exception group says what its tasks raised, not "unhandled errors in a
TaskGroup"."""

from dynarl.core.errors import ConfigError, in_words


def test_an_error_is_its_type_and_first_line() -> None:
    assert in_words(ValueError("bad value\nmore")) == "ValueError: bad value"


def test_an_exception_group_reads_as_its_leaves_in_order() -> None:
    inner = ExceptionGroup("inner", [KeyError("k"), ConfigError("x=1: set x=2")])
    group = ExceptionGroup("unhandled errors in a TaskGroup", [RuntimeError("first"), inner])
    assert in_words(group) == "RuntimeError: first; KeyError: 'k'; ConfigError: x=1: set x=2"
