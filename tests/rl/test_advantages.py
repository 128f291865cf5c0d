"""Group-relative advantages: GRPO's normalisation and its relatives."""

import numpy as np
import pytest

from dynarl.rl.advantages import AdvantageError, group_advantages, whiten


def test_grpo_advantages_are_normalised_within_each_group() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5, 0.2, 0.8]
    groups = [0, 0, 0, 0, 1, 1]
    adv = group_advantages(rewards, groups, eps=0.0)
    first = np.array([1.0, 0.0, 0.5, 0.5])
    expected = (first - first.mean()) / first.std()
    np.testing.assert_allclose(adv[:4], expected)
    np.testing.assert_allclose(adv[4:], [-1.0, 1.0])


def test_a_group_with_equal_rewards_gets_zero_advantage() -> None:
    adv = group_advantages([0.7, 0.7, 0.7, 0.0, 1.0], [3, 3, 3, 5, 5])
    np.testing.assert_array_equal(adv[:3], 0.0)
    assert adv[3] < 0 < adv[4]


def test_groups_may_come_interleaved_and_uneven() -> None:
    rewards = np.array([0.0, 1.0, 1.0, 0.5, 0.0, 0.3, 0.9])
    groups = np.array([7, 2, 7, 2, 7, 9, 9])
    adv = group_advantages(rewards, groups)
    for g in (7, 2, 9):
        sel = groups == g
        expected = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
        np.testing.assert_allclose(adv[sel], expected)


def test_group_mean_and_leave_one_out_baselines() -> None:
    rewards, groups = [1.0, 0.0, 0.5, 2.0], [0, 0, 0, 1]
    np.testing.assert_allclose(
        group_advantages(rewards, groups, baseline="group-mean"), [0.5, -0.5, 0.0, 0.0]
    )
    # RLOO: compared with the mean of the *other* samples; a lone sample gets 0.
    np.testing.assert_allclose(
        group_advantages(rewards, groups, baseline="leave-one-out"), [0.75, -0.75, 0.0, 0.0]
    )


def test_mismatched_or_non_finite_rewards_are_refused() -> None:
    with pytest.raises(AdvantageError, match="group id"):
        group_advantages([1.0, 2.0], [0])
    with pytest.raises(AdvantageError, match="finite"):
        group_advantages([1.0, float("nan")], [0, 0])


def test_whiten() -> None:
    out = whiten([1.0, 2.0, 3.0])
    assert abs(out.mean()) < 1e-12
    assert abs(out.std() - 1.0) < 1e-5
    np.testing.assert_array_equal(whiten([4.0, 4.0]), 0.0)
