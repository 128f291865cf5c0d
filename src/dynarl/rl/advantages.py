"""Advantages from rewards: GRPO's group normalisation and its cheap relatives.

Pure numpy. Every function takes the rewards of one iteration as a flat array and the
group (prompt) each sample belongs to, so groups may have different sizes and samples
may come in any order (completions finish out of order).
"""

from typing import Literal

import numpy as np
import numpy.typing as npt

from dynarl.core.errors import DynaRLError

FloatArray = npt.NDArray[np.float64]

Baseline = Literal["group-norm", "group-mean", "leave-one-out"]
"""How a sample's reward is compared with the rest of its group:

- ``group-norm`` (GRPO): ``(r - mean) / (std + eps)`` over the group;
- ``group-mean`` (Dr. GRPO): ``r - mean``, without dividing by the standard deviation,
  which otherwise up-weights near-solved and near-hopeless prompts;
- ``leave-one-out`` (RLOO): ``r - mean of the other samples``; a group of one gives 0.
"""


class AdvantageError(DynaRLError):
    """Rewards and group ids do not fit together (lengths differ, a reward is not
    finite); the message names what to fix."""


def group_advantages(
    rewards: npt.ArrayLike,
    group_ids: npt.ArrayLike,
    *,
    baseline: Baseline = "group-norm",
    eps: float = 1e-6,
) -> FloatArray:
    """The advantage of each sample: its reward relative to its group's.

    Args:
        rewards: one reward per sample.
        group_ids: the group (prompt) of each sample; any hashable integers.
        baseline: see :data:`Baseline`.
        eps: added to the group's standard deviation (``group-norm`` only).

    Returns:
        float64 advantages, one per sample, in the input order. A group whose rewards
        are all equal carries no signal and gets 0 everywhere (not ``0 / eps`` noise).
    """
    r = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(group_ids)
    if r.ndim != 1 or groups.shape != r.shape:
        raise AdvantageError(
            f"got {r.shape} rewards and {groups.shape} group ids; pass one flat group id per reward"
        )
    if not np.all(np.isfinite(r)):
        raise AdvantageError("rewards must be finite; check the verifier's output")
    advantages = np.zeros_like(r)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=r)
    means = sums / counts
    centred = r - means[inverse]
    # Population std, as GRPO implementations compute it over the G samples of a group.
    variances = np.bincount(inverse, weights=centred**2) / counts
    stds = np.sqrt(variances)
    constant = stds[inverse] <= 1e-12 * np.maximum(1.0, np.abs(means[inverse]))
    if baseline == "group-norm":
        advantages = centred / (stds[inverse] + eps)
    elif baseline == "group-mean":
        advantages = centred
    else:
        others = counts[inverse] - 1
        loo_means = (sums[inverse] - r) / np.maximum(others, 1)
        advantages = np.where(others > 0, r - loo_means, 0.0)
    advantages[constant] = 0.0
    return advantages


def whiten(values: npt.ArrayLike, *, eps: float = 1e-6) -> FloatArray:
    """``values`` shifted and scaled to mean 0 and standard deviation 1 over the whole
    batch (PPO's batch-level advantage whitening); all-equal values give zeros."""
    v = np.asarray(values, dtype=np.float64)
    std = float(v.std()) if v.size else 0.0
    if std <= 1e-12:
        return np.zeros_like(v)
    whitened: FloatArray = (v - v.mean()) / (std + eps)
    return whitened
