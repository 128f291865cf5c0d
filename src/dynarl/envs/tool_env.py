"""A base class for environments whose episodes are tool calls, then an answer.

A subclass writes what is particular to its task and inherits the
:class:`~dynarl.envs.environment.Environment` protocol::

    class Calculator(ToolEnvironment):
        async def setup(self, task: Prompt) -> list[ChatMessage]:
            return [{"role": "user", "content": task.text}]

        async def score(self, answer: str) -> float:
            return float(answer.strip() == self.task.answer)

        @tool
        def calculate(self, expression: str) -> str:
            \"\"\"Evaluate an arithmetic expression.\"\"\"
            ...

Each turn is read by the class's :attr:`~ToolEnvironment.parser`. A turn without a
call is the final answer: it is scored and ends the episode. Otherwise the calls run
and their results go back to the model; so does every mistake of the model's (a
malformed call, an unknown tool, bad arguments, a tool that raised or timed out), as
an ``"Error: ..."`` message, counted in the step's metrics. Only an
:class:`~dynarl.envs.environment.EnvironmentFailure` (and a bug in the environment
itself) ends the episode unscored.
"""

import abc
import copy
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import anyio

from dynarl.core.errors import DynaRLError
from dynarl.envs.environment import ChatMessage, StepResult, Turn
from dynarl.envs.prompts import Prompt
from dynarl.envs.tool_parser import HermesParser, ToolCall, ToolCallParser
from dynarl.envs.tools import AnyToolSpec, ToolDefinitionError, tools_of


class ToolEnvironmentError(DynaRLError):
    """A tool environment was used out of order (``task`` before ``reset``) or its
    ``score`` returned something that is not a finite number."""


class ToolEnvironment(abc.ABC):
    """One episode of a task solved with the ``@tool`` methods of a subclass.

    Subclasses implement :meth:`setup` and :meth:`score`, and may override
    :meth:`hidden_arguments` and :meth:`close`. The tools are collected, and their
    names checked, when the subclass is created; their schemas are built on first use.

    Calls of one turn run in the order written, one at a time, so a call may rely on
    the effect of the one before (write a file, then run it) and episode state needs
    no lock. At most :attr:`max_tool_calls_per_turn` run; each extra call is answered
    with an error. Each result is a ``{"role": "tool", "name": ..., "content": ...}``
    message, in call order; a malformed call is answered by a ``"tool"`` message too
    (without a name), after the results, since chat templates render tool messages
    as the tools' answer rather than as the user speaking.

    Per-step metrics: ``tool_calls`` (well-formed calls, run or not),
    ``tool_errors`` (those whose answer is an error: unknown tool, invalid arguments,
    raised, timed out, over the per-turn limit), ``parse_errors`` (malformed calls),
    ``tool_s`` (time spent running the calls) and ``tool_calls/<name>`` for each tool
    of this environment that was called.
    """

    parser: ClassVar[ToolCallParser] = HermesParser()
    """Reads the model family's tool calls out of a turn."""
    max_tool_calls_per_turn: ClassVar[int] = 8
    """Calls run per turn; the model is told about each one over the limit."""

    _tools: ClassVar[Mapping[str, AnyToolSpec]] = MappingProxyType({})
    _task: Prompt | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.max_tool_calls_per_turn < 1:
            raise ToolDefinitionError(
                f"{cls.__qualname__}.max_tool_calls_per_turn="
                f"{cls.max_tool_calls_per_turn} must be at least 1"
            )
        cls._tools = tools_of(cls)

    @abc.abstractmethod
    async def setup(self, task: Prompt) -> list[ChatMessage]:
        """Start an episode on ``task`` (open a sandbox, set episode state): the first
        messages of the conversation, such as a system prompt and the task."""

    @abc.abstractmethod
    async def score(self, answer: str) -> float:
        """The reward of the final ``answer`` (the text of a turn without tool calls;
        also a turn cut off by its token limit). :attr:`task` is the episode's task."""

    def hidden_arguments(self) -> dict[str, Any]:
        """Values of the tools' hidden parameters for this episode (a secret, a
        sandbox handle), by parameter name; read before each turn's calls run."""
        return {}

    async def close(self) -> None:
        """Release what the episode holds; called once, however the episode ended.
        Nothing to release by default."""
        return

    @property
    def task(self) -> Prompt:
        """The task of the episode, as given to :meth:`reset`."""
        if self._task is None:
            raise ToolEnvironmentError(
                f"{type(self).__qualname__} has no task yet; call reset(task) first"
            )
        return self._task

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools' schemas in OpenAI function format (hidden parameters left out),
        for the chat template's tool prompt."""
        return [copy.deepcopy(spec.schema) for spec in self._tools.values()]

    async def reset(self, task: Prompt) -> list[ChatMessage]:
        """Start the episode on ``task``: the messages of :meth:`setup`."""
        self._task = task
        return await self.setup(task)

    async def step(self, turn: Turn) -> StepResult:
        """Run the turn's tool calls and answer them, or score its final answer."""
        parsed = self.parser.parse(turn.text)
        metrics = {
            "tool_calls": float(len(parsed.calls)),
            "tool_errors": 0.0,
            "parse_errors": float(len(parsed.errors)),
            "tool_s": 0.0,
        }
        if not parsed.calls and not parsed.errors:
            reward = await self.score(parsed.content)
            if not isinstance(reward, int | float) or not math.isfinite(reward):
                raise ToolEnvironmentError(
                    f"{type(self).__qualname__}.score returned {reward!r}; return a finite number"
                )
            return StepResult(reward=float(reward), done=True, metrics=metrics)
        observation: list[ChatMessage] = []
        if parsed.calls:
            hidden = self._checked_hidden_arguments()
            start_s = anyio.current_time()
            for number, call in enumerate(parsed.calls):
                message, ok = await self._answer(call, number, hidden)
                observation.append(message)
                metrics["tool_errors"] += 0.0 if ok else 1.0
                if call.name in self._tools:
                    key = f"tool_calls/{call.name}"
                    metrics[key] = metrics.get(key, 0.0) + 1.0
            metrics["tool_s"] = anyio.current_time() - start_s
        for error in parsed.errors:
            observation.append({"role": "tool", "content": f"Error: {error.message}"})
        return StepResult(observation=tuple(observation), metrics=metrics)

    async def _answer(
        self, call: ToolCall, number: int, hidden: Mapping[str, Any]
    ) -> tuple[ChatMessage, bool]:
        """The tool message answering ``call`` (the ``number``-th of its turn), and
        whether it succeeded."""
        spec = self._tools.get(call.name)
        if number >= self.max_tool_calls_per_turn:
            limit = self.max_tool_calls_per_turn
            content = (
                f"Error: not run: at most {limit} tool calls run per turn; make the "
                "others in your next turn"
            )
            ok = False
        elif spec is None:
            known = ", ".join(self._tools) or "none"
            content = f"Error: there is no tool {call.name!r}; the tools are: {known}"
            ok = False
        else:
            output = await spec.call(self, call.arguments, hidden=hidden)
            content, ok = output.content, output.ok
        return {"role": "tool", "name": call.name, "content": content}, ok

    def _checked_hidden_arguments(self) -> dict[str, Any]:
        """:meth:`hidden_arguments`, refusing names no tool hides (a typo would
        otherwise leave a tool without its value)."""
        values = self.hidden_arguments()
        hidden = set().union(*(spec.hidden for spec in self._tools.values()))
        if unknown := sorted(set(values) - hidden):
            raise ToolDefinitionError(
                f"{type(self).__qualname__}.hidden_arguments() gives {unknown}, which no "
                f"tool hides; tools hide: {', '.join(sorted(hidden)) or 'nothing'}"
            )
        return values
