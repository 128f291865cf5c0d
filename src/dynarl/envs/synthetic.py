"""The embedded default task: close the brackets.

The prompt is ``N`` opening brackets, ``"(((((("``; the correct response is ``N``
closing brackets, ``"))))))"``, then end-of-sequence. ``N`` is drawn per prompt from a
lognormal distribution, capped, so the correct response lengths are heavy-tailed by
construction: most answers are a few tokens, a few are many times the median, like the
reasoning traces of math RL.

Why a tiny random-init model learns it by RL with a character-level tokenizer:

- the content is one token (``)``), a unigram the policy picks up in a few steps;
- when to stop is *local*: stop once the closing brackets balance the opening ones.
  One attention head attending evenly over the context reads the fraction of closing
  brackets, and a threshold at one half is the stopping rule, so no counting circuit
  is needed (it gets less precise as ``N`` grows, which keeps the tail imperfect);
- the reward (:class:`~dynarl.envs.verifier.MatchVerifier`) gives partial credit for
  length and content, so even the first, random responses differ in reward within a
  group.

Prompts are a pure function of ``(seed, index)``, so any run can regenerate them.
"""

import math
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.core.errors import ConfigError
from dynarl.envs.prompts import Prompt
from dynarl.envs.verifier import MatchVerifier

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class SyntheticConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape of the synthetic task.

    Attributes:
        median_length: median correct response length (closing brackets, before EOS).
        sigma: standard deviation of the log length: 1.0 puts the 99th percentile near
            10x the median, 1.3 near 20x.
        max_length: longest correct response; keep it below the rollout's
            ``max_new_tokens`` so every answer fits with its EOS.
        open_char, close_char: the bracket pair (single characters).
    """

    median_length: PositiveFloat = 6.0
    sigma: Annotated[float, msgspec.Meta(ge=0.0)] = 1.1
    max_length: PositiveInt = 120
    open_char: str = "("
    close_char: str = ")"

    def __post_init__(self) -> None:
        if len(self.open_char) != 1 or len(self.close_char) != 1:
            raise ConfigError(
                "synthetic open_char and close_char must be single characters",
                field="synthetic.open_char",
            )
        if self.open_char == self.close_char:
            raise ConfigError(
                "synthetic open_char and close_char must differ", field="synthetic.close_char"
            )


class SyntheticTask:
    """Prompts of the bracket task and the verifier that scores them.

    Args:
        config: the task's shape.
        seed: prompt ``i`` depends on ``(seed, i)`` only.
    """

    def __init__(self, config: SyntheticConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or SyntheticConfig()
        self.seed = seed

    def answer_length(self, index: int) -> int:
        """Correct response length (without EOS) of prompt ``index``."""
        cfg = self.config
        z = float(np.random.default_rng([self.seed, index]).standard_normal())
        length = round(math.exp(math.log(cfg.median_length) + cfg.sigma * z))
        return min(max(length, 1), cfg.max_length)

    def prompt(self, index: int) -> Prompt:
        """Prompt ``index``: ``N`` opening brackets, with its answer and ``N`` as
        ``metadata["length"]``."""
        length = self.answer_length(index)
        cfg = self.config
        return Prompt(
            prompt_id=f"synthetic-{self.seed}-{index}",
            text=cfg.open_char * length,
            answer=cfg.close_char * length,
            metadata={"length": length},
        )

    def answer_lengths(self, num_prompts: int, *, start: int = 0) -> npt.NDArray[np.int64]:
        """Correct response lengths of prompts ``start .. start + num_prompts - 1``."""
        return np.array(
            [self.answer_length(i) for i in range(start, start + num_prompts)], dtype=np.int64
        )

    def verifier(self) -> MatchVerifier:
        """The task's rule-based verifier."""
        return MatchVerifier()
