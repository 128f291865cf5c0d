"""The built-in environments a configuration names (``env.name``), imported only when
a run plays one; a user's own environment is passed in code instead
(``DynaRL(cfg, environment=...)``)."""

import importlib
from collections.abc import Callable
from typing import Literal, cast

from dynarl.envs.environment import EnvironmentSpec

BuiltinName = Literal["lookup", "calculator", "python-tests"]
"""The names ``env.name`` takes."""

_BUILTIN: dict[str, tuple[str, str]] = {
    "lookup": ("dynarl.envs.lookup", "lookup_spec"),
    "calculator": ("dynarl.envs.calculator", "calculator_spec"),
    "python-tests": ("dynarl.envs.python_tests", "python_tests_spec"),
}


def builtin_environment(name: BuiltinName, *, seed: int) -> EnvironmentSpec:
    """The built-in environment ``name``, its tasks drawn from ``seed``."""
    module, function = _BUILTIN[name]
    make = cast(
        Callable[[int], EnvironmentSpec], getattr(importlib.import_module(module), function)
    )
    return make(seed)
