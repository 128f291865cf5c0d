"""Recipes: functions returning configurations. Derive new ones from these with
``msgspec.structs.replace`` or :func:`dynarl.api.config_io.apply_overrides`."""

from dynarl.api.config import DynaRLConfig


def default() -> DynaRLConfig:
    """The embedded default: a tiny CPU run with dynamic scheduling on 4 device slots."""
    return DynaRLConfig()


def math_tiny() -> DynaRLConfig:
    """Alias of :func:`default`, named after the task it runs."""
    return default()


__all__ = ["default", "math_tiny"]
