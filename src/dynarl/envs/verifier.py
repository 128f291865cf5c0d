"""Rewards from rules: the :class:`Verifier` seam, the built-in reference-match verifier,
and :class:`AsyncVerifier`, which runs any (possibly slow, synchronous) verifier off the
event loop.

A verifier is a plain function of a prompt and a decoded response returning a reward
in ``[0, 1]``. It may take its time (run tests, call a checker): the reward component
calls it through :class:`AsyncVerifier`, which runs it in worker threads, a bounded
number at a time, so the controller's event loop keeps ticking meanwhile.
"""

import math
from collections.abc import Sequence
from typing import Annotated, Protocol

import anyio
import anyio.to_thread
import msgspec

from dynarl.core.errors import DynaRLError
from dynarl.envs.prompts import Prompt


class VerifierError(DynaRLError):
    """A verifier cannot score a response (the prompt has no reference answer) or
    returned something that is not a reward in ``[0, 1]``."""


class Verifier(Protocol):
    """Scores one response; must be thread-safe (several run at once in threads)."""

    def __call__(self, prompt: Prompt, response: str) -> float:
        """The reward, in ``[0, 1]``, of ``response`` (decoded text, without the
        end-of-sequence token) to ``prompt``."""
        ...


class MatchVerifier(msgspec.Struct, frozen=True, kw_only=True):
    """Rule-based reward against the prompt's reference answer, with partial credit.

    The reward is 1 for an exact match. Otherwise it mixes two scores in ``[0, 1]``:

    - length: ``(min(L, N) + 1) / (max(L, N) + 1)`` for a response of ``L`` characters
      and an answer of ``N`` (stopping too early and too late both cost);
    - content: characters equal to the answer's at the same position, over
      ``max(L, N)``.

    Partial credit makes the signal dense enough for a randomly initialised policy:
    its responses differ in length and content from the first iteration, so every
    group has reward variance to learn from.

    Attributes:
        length_weight: weight of the length score (the content score gets the rest).
    """

    length_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5

    def __call__(self, prompt: Prompt, response: str) -> float:
        """The reward of ``response`` against ``prompt.answer``."""
        answer = prompt.answer
        if answer is None:
            raise VerifierError(
                f"prompt {prompt.prompt_id!r} has no reference answer; give records an "
                "'answer' field or plug in a verifier that needs none"
            )
        if response == answer:
            return 1.0
        n, length = len(answer), len(response)
        length_score = (min(length, n) + 1) / (max(length, n) + 1)
        matches = sum(a == b for a, b in zip(response, answer, strict=False))
        content_score = matches / max(length, n, 1)
        return self.length_weight * length_score + (1.0 - self.length_weight) * content_score


def check_reward(reward: float, *, prompt_id: str = "") -> float:
    """``reward`` as a float if it is a finite number in ``[0, 1]``; else
    :class:`VerifierError`."""
    value = float(reward)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise VerifierError(
            f"the verifier returned {reward!r} for prompt {prompt_id!r}; rewards must be "
            "finite numbers in [0, 1]"
        )
    return value


class AsyncVerifier:
    """Runs a synchronous :class:`Verifier` in worker threads without blocking the
    event loop.

    Use one instance within one event loop (its limiter belongs to that loop).

    Args:
        verifier: the rule to run.
        max_concurrency: verifier calls running at once (threads); the rest wait.
    """

    def __init__(self, verifier: Verifier, *, max_concurrency: int = 4) -> None:
        if max_concurrency < 1:
            raise VerifierError(f"max_concurrency={max_concurrency} must be at least 1")
        self.verifier = verifier
        self._max_concurrency = max_concurrency
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def max_concurrency(self) -> int:
        """Verifier calls allowed to run at once."""
        return self._max_concurrency

    async def score(self, prompt: Prompt, response: str) -> float:
        """The checked reward of one response, computed in a worker thread."""
        if self._limiter is None:  # created in the running loop's backend
            self._limiter = anyio.CapacityLimiter(self._max_concurrency)
        reward = await anyio.to_thread.run_sync(
            self.verifier, prompt, response, limiter=self._limiter
        )
        return check_reward(reward, prompt_id=prompt.prompt_id)

    async def score_many(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        """The rewards of ``(prompt, response)`` pairs, in order, computed concurrently
        (at most ``max_concurrency`` at a time)."""
        rewards = [0.0] * len(items)

        async def one(index: int) -> None:
            prompt, response = items[index]
            rewards[index] = await self.score(prompt, response)

        async with anyio.create_task_group() as tg:
            for index in range(len(items)):
                tg.start_soon(one, index)
        return rewards


def score_all(verifier: Verifier, items: Sequence[tuple[Prompt, str]]) -> list[float]:
    """Checked rewards of ``(prompt, response)`` pairs, computed here and in order (for
    synchronous loops; an event loop uses :class:`AsyncVerifier`)."""
    return [check_reward(verifier(p, r), prompt_id=p.prompt_id) for p, r in items]
