"""A workload that replays measured requests, iteration by iteration.

A real run's per-request lengths (see ``bench/e2e_cpu.py``) replayed through the
simulator let a prediction be checked against the very run it describes.
"""

import msgspec
import numpy as np

from dynarl.sim.errors import SimError
from dynarl.sim.workloads import Request


class ReplayWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Measured requests, replayed: iteration ``i`` gets ``iterations[i]`` (the last
    one again past the end)."""

    iterations: tuple[tuple[Request, ...], ...]
    num_prompts: int
    group_size: int
    max_output_tokens: int

    def generate(self, rng: np.random.Generator, *, iteration: int = 0) -> tuple[Request, ...]:
        """The requests of ``iteration`` (``rng`` is unused: a replay is exact)."""
        if not self.iterations:
            raise SimError("a replay workload needs at least one recorded iteration")
        return self.iterations[min(iteration, len(self.iterations) - 1)]
