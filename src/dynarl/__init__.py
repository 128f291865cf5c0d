"""dynarl: reinforcement learning for LLMs that moves accelerators to the bottleneck.

The package root stays light: it imports no torch, sglang or megatron. Backends are
imported lazily by name when a run needs them.
"""

from dynarl.core.errors import ConfigError, DynaRLError

__all__ = ["ConfigError", "DynaRLError", "__version__"]

__version__ = "0.1.0"
