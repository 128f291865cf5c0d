"""What every configuration section shares: the frozen, keyword-only ``Section`` base
that rejects unknown keys, and the constrained number types the sections use.

Each component owns its section beside its code (``workers/config.py``,
``rl/config.py``, ...); :mod:`dynarl.api.config` assembles them into the run's tree.
"""

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]

Accelerator = Literal["cpu", "cuda"]
"""What a run's devices are (``cluster.accelerator``): CPU slots, or CUDA GPUs."""


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, keyword-only, unknown keys rejected."""
