"""Response-length distributions a simulated single-turn workload draws from.

Three shapes, chosen in ``sim.output_lengths`` by their ``kind``:

- :class:`Lognormal` — a group draws its log-median around ``median_tokens`` with
  spread ``group_sigma``, each sample adds ``sample_sigma`` of its own (the built-in
  math workload's shape);
- :class:`Mixture` — each group picks one lognormal component by weight (a workload
  of short and long problems, say);
- :class:`Histogram` — an empirical histogram of measured lengths (bin edges and
  counts), with a within-group correlation (a Gaussian copula), so samples of one
  prompt tend to be long or short together.

Each draws a ``(num_prompts, group_size)`` array of lengths in tokens, before the
workload clips them to its minimum and its ``max_output_tokens``.
"""

import math
from typing import Annotated

import msgspec
import numpy as np

from dynarl.core.config import NonNegativeFloat, PositiveFloat, PositiveInt
from dynarl.core.errors import ConfigError

_FIELD = "sim.output_lengths"


class Lognormal(
    msgspec.Struct,
    tag="lognormal",
    tag_field="kind",
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
):
    """Lognormal lengths with within-group correlation
    ``group_sigma² / (group_sigma² + sample_sigma²)``.

    Attributes:
        median_tokens: median response length.
        group_sigma: spread of a group's log-median around ``log(median_tokens)``.
        sample_sigma: spread of a sample's log-length around its group's.
    """

    median_tokens: PositiveInt = 2000
    group_sigma: NonNegativeFloat = 1.6
    sample_sigma: NonNegativeFloat = 0.9

    def sample(self, rng: np.random.Generator, num_prompts: int, group_size: int) -> np.ndarray:
        """A ``(num_prompts, group_size)`` array of lengths in tokens."""
        log_median = math.log(self.median_tokens) + self.group_sigma * rng.standard_normal(
            num_prompts
        )
        log_len = log_median[:, None] + self.sample_sigma * rng.standard_normal(
            (num_prompts, group_size)
        )
        return np.exp(log_len)


class Mixture(
    msgspec.Struct,
    tag="mixture",
    tag_field="kind",
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
):
    """A mixture of lognormals: each group draws from one component, picked with
    probability proportional to its weight.

    Attributes:
        components: the lognormal components.
        weights: one positive weight per component (normalised to sum to 1).
    """

    components: tuple[Lognormal, ...]
    weights: tuple[PositiveFloat, ...]

    def __post_init__(self) -> None:
        if not self.components or len(self.weights) != len(self.components):
            raise ConfigError(
                f"{_FIELD}: a mixture needs one weight per component, got "
                f"{len(self.weights)} weights for {len(self.components)} components; "
                "give `weights` the same length as `components` (at least one)",
                field=f"{_FIELD}.weights",
            )

    def sample(self, rng: np.random.Generator, num_prompts: int, group_size: int) -> np.ndarray:
        """A ``(num_prompts, group_size)`` array of lengths in tokens."""
        p = np.asarray(self.weights) / sum(self.weights)
        pick = rng.choice(len(self.components), size=num_prompts, p=p)
        median = np.log([c.median_tokens for c in self.components])[pick]
        group_sigma = np.array([c.group_sigma for c in self.components])[pick]
        sample_sigma = np.array([c.sample_sigma for c in self.components])[pick]
        log_median = median + group_sigma * rng.standard_normal(num_prompts)
        noise = rng.standard_normal((num_prompts, group_size))
        return np.exp(log_median[:, None] + sample_sigma[:, None] * noise)


class Histogram(
    msgspec.Struct,
    tag="histogram",
    tag_field="kind",
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
):
    """An empirical histogram of response lengths: bin ``k`` holds lengths in
    ``[edges[k], edges[k+1])`` with weight ``counts[k]``, uniform within the bin.

    Attributes:
        edges: increasing bin edges in tokens (one more than ``counts``).
        counts: how many responses (or what fraction) fell in each bin.
        group_correlation: correlation of two samples of one prompt, on the normal
            scale of a Gaussian copula (0: independent; the built-in lognormal's is 0.76).
    """

    edges: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    counts: tuple[NonNegativeFloat, ...]
    group_correlation: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.76

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.counts) + 1 or not self.counts:
            raise ConfigError(
                f"{_FIELD}: a histogram of {len(self.counts)} bins needs "
                f"{len(self.counts) + 1} edges, got {len(self.edges)}; give one more "
                "edge than counts (at least one bin)",
                field=f"{_FIELD}.edges",
            )
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise ConfigError(
                f"{_FIELD}.edges={list(self.edges)} must increase strictly",
                field=f"{_FIELD}.edges",
            )
        if sum(self.counts) <= 0:
            raise ConfigError(
                f"{_FIELD}.counts are all zero: give at least one bin a positive count",
                field=f"{_FIELD}.counts",
            )

    def sample(self, rng: np.random.Generator, num_prompts: int, group_size: int) -> np.ndarray:
        """A ``(num_prompts, group_size)`` array of lengths in tokens."""
        rho = self.group_correlation
        shared = rng.standard_normal(num_prompts)[:, None]
        own = rng.standard_normal((num_prompts, group_size))
        z = math.sqrt(rho) * shared + math.sqrt(1.0 - rho) * own
        u = np.clip(0.5 * (1.0 + _erf(z / math.sqrt(2.0))), 0.0, 1.0 - 1e-12)
        weights = np.asarray(self.counts, dtype=np.float64)
        cdf = np.concatenate([[0.0], np.cumsum(weights / weights.sum())])
        k = np.clip(np.searchsorted(cdf, u, side="right") - 1, 0, len(weights) - 1)
        lo, hi = np.asarray(self.edges[:-1])[k], np.asarray(self.edges[1:])[k]
        within = (u - cdf[k]) / np.maximum(cdf[k + 1] - cdf[k], 1e-300)
        return np.asarray(lo + np.clip(within, 0.0, 1.0) * (hi - lo), dtype=np.float64)


LengthDistribution = Lognormal | Mixture | Histogram
"""Any of the response-length distributions, told apart by ``kind``."""

_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(_ERF(x), dtype=np.float64)
