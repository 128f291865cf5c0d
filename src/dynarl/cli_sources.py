"""Where a command's configuration comes from: the embedded default, a recipe named on
the command line (a function in ``recipes`` that takes no argument) or a config file,
with ``--set`` overrides applied. Shared by every ``dynarl`` command."""

import importlib
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, read_config_file
from dynarl.core.errors import ConfigError


def resolve_source(source: str | None) -> msgspec.Struct | dict[str, Any]:
    """What ``source`` names, before overrides: the embedded default (``None``), a
    recipe's result (a function in ``recipes`` that takes no argument), or a config
    file's tree of builtins."""
    if source is None:
        return DynaRLConfig()
    if Path(source).suffix.lower() in (".yaml", ".yml", ".toml", ".json"):
        return read_config_file(source)
    recipes = importlib.import_module("recipes")
    named = {n: getattr(recipes, n) for n in getattr(recipes, "__all__", ())}
    # Recipes the command line can name: those that need no argument.
    runnable = {n: f for n, f in named.items() if callable(f) and _takes_no_argument(f)}
    factory = runnable.get(source)
    if factory is None:
        known = ", ".join(sorted(runnable))
        hint = (
            f"recipe {source!r} takes arguments; call it from Python"
            if source in named
            else f"no recipe {source!r}"
        )
        raise ConfigError(f"{hint}; recipes to name here: {known} (or a config file)")
    made = factory()
    if not isinstance(made, msgspec.Struct):
        raise ConfigError(f"recipe {source!r} returned a {type(made).__name__}, not a config")
    return made


def resolve_config(source: str | None, overrides: Sequence[str]) -> DynaRLConfig:
    """A run's config from a recipe name, a file, or the embedded default, with
    ``overrides`` applied."""
    base = resolve_source(source)
    if isinstance(base, msgspec.Struct) and not isinstance(base, DynaRLConfig):
        raise ConfigError(
            f"{source!r} is a {type(base).__name__}, not a run's configuration; "
            f"simulate it with `dynarl sim {source}`"
        )
    return apply_overrides(base, overrides)


def _takes_no_argument(factory: Callable[..., object]) -> bool:
    parameters = inspect.signature(factory).parameters.values()
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters
    )
