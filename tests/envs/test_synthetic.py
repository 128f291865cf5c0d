"""The embedded bracket task: deterministic prompts, heavy-tailed answer lengths."""

import numpy as np
import pytest

from dynarl.core.errors import ConfigError
from dynarl.envs.synthetic import SyntheticConfig, SyntheticTask


def test_prompts_are_deterministic_and_consistent() -> None:
    task = SyntheticTask(seed=1)
    assert task.prompt(17) == SyntheticTask(seed=1).prompt(17)
    assert [task.prompt(i) for i in range(20)] != [
        SyntheticTask(seed=2).prompt(i) for i in range(20)
    ]
    for i in range(50):
        p = task.prompt(i)
        n = p.metadata["length"]
        assert p.text == "(" * n and p.answer == ")" * n
        assert task.verifier()(p, ")" * n) == 1.0


def test_answer_lengths_are_heavy_tailed_and_capped() -> None:
    lengths = SyntheticTask(seed=0).answer_lengths(5000)
    median = float(np.median(lengths))
    p99 = float(np.percentile(lengths, 99))
    assert 5 <= median <= 7
    assert p99 / median > 8  # a long tail, like reasoning traces in math RL
    assert lengths.min() >= 1 and lengths.max() <= SyntheticConfig().max_length
    # The longest 10% of answers hold a large share of all tokens.
    top = np.sort(lengths)[::-1][: len(lengths) // 10]
    assert top.sum() / lengths.sum() > 0.3


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="single characters"):
        SyntheticConfig(open_char="((")
    with pytest.raises(ConfigError, match="differ"):
        SyntheticConfig(open_char="x", close_char="x")
    short = SyntheticTask(SyntheticConfig(median_length=3.0, sigma=0.0, max_length=2))
    assert short.answer_lengths(5).tolist() == [2] * 5
