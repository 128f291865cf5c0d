"""Recipes: functions returning configurations. Derive new ones from these with
``msgspec.structs.replace`` or :func:`dynarl.api.config_io.apply_overrides`."""

from dynarl.api.config import DynaRLConfig
from recipes.agentic import agentic_tiny
from recipes.e2e import e2e_cpu
from recipes.paper import agentic_7b_64, math_1_5b_64, math_7b_64, math_32b_64, paper_setting


def default() -> DynaRLConfig:
    """The embedded default: a tiny CPU run with dynamic scheduling on 4 device slots."""
    return DynaRLConfig()


def math_tiny() -> DynaRLConfig:
    """Alias of :func:`default`, named after the task it runs."""
    return default()


__all__ = [
    "agentic_7b_64",
    "agentic_tiny",
    "default",
    "e2e_cpu",
    "math_1_5b_64",
    "math_7b_64",
    "math_32b_64",
    "math_tiny",
    "paper_setting",
]
