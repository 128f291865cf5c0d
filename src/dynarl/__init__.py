"""dynarl: reinforcement learning for LLMs that moves accelerators to the bottleneck.

The package root stays light: it imports no torch, sglang or megatron. Backends are
imported lazily by name when a run needs them.
"""

from typing import TYPE_CHECKING

from dynarl.core.errors import ConfigError, DynaRLError

if TYPE_CHECKING:
    from dynarl.api.facade import DynaRL

__all__ = ["ConfigError", "DynaRL", "DynaRLError", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The facade is imported on first use, so `import dynarl` stays light.
    if name == "DynaRL":
        from dynarl.api.facade import DynaRL

        return DynaRL
    raise AttributeError(f"module 'dynarl' has no attribute {name!r}")
