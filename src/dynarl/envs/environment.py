"""The environment protocol: what a user writes to train on a multi-turn task.

One :class:`Environment` instance plays one episode, async throughout::

    env = make()                       # one per episode
    messages = await env.reset(task)   # the conversation so far (system, user, ...)
    while True:
        turn = ...                     # the policy's next assistant turn (text + ids)
        result = await env.step(turn)  # tool output / feedback, reward, done, metrics
        if result.done: break
    await env.close()                  # always: also on a timeout, an error or a cancel

The framework owns the tokens: it keeps the ids the engine sampled, and renders only
the observation messages an environment returns, through the model's chat template
(:mod:`dynarl.rl.turns`). An environment sees text and structured messages, never
token ids it must keep consistent.

An environment signals an *infrastructure* failure (its sandbox died, a service is
unreachable) by raising :class:`EnvironmentFailure`: the episode is aborted, counted,
and left out of training instead of being scored 0. Any other exception escaping
:meth:`Environment.step` is a bug in the environment and counts the same way, with its
traceback logged.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NotRequired, Protocol, TypedDict

import msgspec

from dynarl.core.errors import DynaRLError
from dynarl.envs.prompts import Prompt

Role = Literal["system", "user", "assistant", "tool"]
"""Who speaks a message."""


class ToolCallFunction(TypedDict):
    """The function part of an OpenAI-style tool call."""

    name: str
    arguments: dict[str, Any]


class ToolCallMessagePart(TypedDict):
    """One tool call of an assistant message, as chat templates render them."""

    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(TypedDict):
    """One chat message, as ``transformers`` chat templates take them (a plain dict)."""

    role: Role
    content: str
    name: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallMessagePart]]


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """The policy's assistant turn, as an environment's :meth:`~Environment.step` sees it.

    Attributes:
        text: the decoded turn, without its end-of-turn token.
        token_ids: the ids the engine sampled (the end-of-turn token included when it
            stopped on one); read-only context, the framework keeps them.
        finish_reason: ``stop`` (it ended its turn, or closed a tool call) or
            ``length`` (it ran out of tokens mid-turn).
        index: 0 for the first turn of the episode.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"]
    index: int


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What an environment answers to one turn.

    Attributes:
        observation: messages appended after the turn (tool results, user feedback);
            rendered by the chat template and kept out of the loss. Empty when done.
        reward: reward earned by this turn; an episode's reward is the sum over its
            turns.
        done: the episode is over (the policy answered, or the environment gives up).
        metrics: numbers to report for this turn (summed over the episode per key,
            e.g. ``tool_calls``, ``tool_errors``, ``parse_errors``, ``tool_s``).
    """

    observation: tuple[ChatMessage, ...] = ()
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class EnvironmentFailure(DynaRLError):  # noqa: N818 (EnvironmentError is OSError's)
    """The environment's infrastructure failed (a sandbox died, a service is down): the
    episode is aborted and not scored. Raise it from :meth:`Environment.step` or
    :meth:`Environment.reset`; never for a mistake of the policy's, which goes back to
    the model as an observation."""


class Environment(Protocol):
    """One episode of a multi-turn task."""

    @property
    def tools(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools the policy may call (OpenAI function format), for
        the chat template's tool prompt; empty when there are none."""
        ...

    async def reset(self, task: Prompt) -> list[ChatMessage]:
        """Start the episode on ``task``; the conversation the policy answers first."""
        ...

    async def step(self, turn: Turn) -> StepResult:
        """The environment's answer to the policy's ``turn``."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (sandboxes, sessions). Always called once,
        after the last step, a timeout, an error or a cancellation."""
        ...


EnvironmentFactory = Callable[[], Environment]
"""Makes a fresh environment for each episode (a class with no required arguments)."""


class Demonstrations(Protocol):
    """An environment's worked examples, for a supervised warm start of a random-init
    policy (:mod:`dynarl.envs.warm_start`)."""

    def __call__(self, task: Prompt) -> list[ChatMessage]:
        """A whole conversation solving ``task``: the reset messages, then assistant
        turns and the observations they get, as the environment would play it."""
        ...


class EnvironmentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a run needs to play an environment's episodes.

    Attributes:
        make: a fresh environment per episode.
        task: the task at each index, for ``data.source=synthetic`` (a pure function
            of the index); ``None`` if the environment's tasks come from a file only.
        demonstrations: worked examples for a warm start, if the environment has any.
        name: shown in logs and metrics.
    """

    make: EnvironmentFactory
    task: Callable[[int], Prompt] | None = None
    demonstrations: Demonstrations | None = None
    name: str = "environment"


def episode_metrics(per_turn: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """An episode's metrics: each key summed over its turns."""
    out: dict[str, float] = {}
    for metrics in per_turn:
        for key, value in metrics.items():
            out[key] = out.get(key, 0.0) + float(value)
    return out
