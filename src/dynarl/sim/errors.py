"""Errors the simulator's models raise."""

from dynarl.core.errors import DynaRLError


class SimError(DynaRLError, ValueError):
    """A simulator model was given something it cannot model (an unknown GPU or model
    name, a job that can never fit in an engine's KV cache, a malformed trace); the
    message says what to change."""
