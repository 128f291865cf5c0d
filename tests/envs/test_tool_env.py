"""ToolEnvironment: turns become tool calls and answers, every mistake of the model's
reaches it as a message and is counted, and only infrastructure failures abort."""

import math
from typing import Any, Literal

import anyio
import pytest

from dynarl.envs.environment import (
    ChatMessage,
    Environment,
    EnvironmentFailure,
    StepResult,
    Turn,
)
from dynarl.envs.prompts import Prompt
from dynarl.envs.tool_env import ToolEnvironment, ToolEnvironmentError
from dynarl.envs.tool_parser import HermesParser
from dynarl.envs.tools import ToolDefinitionError, tool

TASK = Prompt(prompt_id="t", text="Store 2 and 3, then add them.", answer="5")
CALL = HermesParser().render


def turn(text: str, finish_reason: Literal["stop", "length"] = "stop") -> Turn:
    return Turn(text=text, token_ids=(1, 2), finish_reason=finish_reason, index=0)


class Notebook(ToolEnvironment):
    """A fake environment: a notepad of numbers, with a secret per episode."""

    max_tool_calls_per_turn = 3

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.closed = False

    async def setup(self, task: Prompt) -> list[ChatMessage]:
        return [{"role": "user", "content": task.text}]

    async def score(self, answer: str) -> float:
        return 1.0 if answer == self.task.answer else 0.0

    def hidden_arguments(self) -> dict[str, Any]:
        return {"secret": f"key-{len(self.numbers)}"}

    @tool
    def write(self, number: int) -> str:
        """Write a number down.

        Args:
            number: the number to keep.
        """
        self.numbers.append(number)
        return f"kept {number}"

    @tool
    async def total(self) -> int:
        """The sum of the numbers so far."""
        await anyio.sleep(0.01)
        return sum(self.numbers)

    @tool(hidden=("secret",))
    def whisper(self, secret: str) -> str:
        """Reveal the episode's secret."""
        return secret

    @tool
    def fail(self, reason: str) -> str:
        """Raise an error."""
        raise ValueError(reason)

    @tool(timeout_s=0.02)
    async def hang(self) -> str:
        """Never return in time."""
        await anyio.sleep(10)
        return ""

    @tool
    async def crash(self) -> str:
        """Lose the sandbox."""
        raise EnvironmentFailure("the sandbox died")

    async def close(self) -> None:
        self.closed = True


async def started() -> Notebook:
    env = Notebook()
    assert await env.reset(TASK) == [{"role": "user", "content": TASK.text}]
    return env


async def test_reset_starts_the_episode_and_the_task_is_kept() -> None:
    env = Notebook()
    with pytest.raises(ToolEnvironmentError, match=r"call reset\(task\) first"):
        env.task  # noqa: B018
    await env.reset(TASK)
    assert env.task is TASK
    await env.close()
    assert env.closed


def test_tools_are_the_schemas_without_hidden_parameters() -> None:
    env: Environment = Notebook()  # satisfies the protocol
    tools = env.tools
    assert [t["function"]["name"] for t in tools] == [
        "write",
        "total",
        "whisper",
        "fail",
        "hang",
        "crash",
    ]
    assert tools[0]["function"]["parameters"]["properties"] == {
        "number": {"type": "integer", "description": "the number to keep."}
    }
    assert tools[2]["function"]["parameters"]["properties"] == {}
    tools[0]["function"]["name"] = "changed"
    assert env.tools[0]["function"]["name"] == "write"


async def test_a_turn_without_calls_is_the_final_answer_and_is_scored() -> None:
    env = await started()
    result = await env.step(turn("5"))
    assert result == StepResult(
        reward=1.0,
        done=True,
        metrics={"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": 0.0, "tool_s": 0.0},
    )
    assert (await env.step(turn("  6 \n"))).reward == 0.0


async def test_a_turn_cut_off_without_a_call_is_still_scored() -> None:
    env = await started()
    result = await env.step(turn("5", finish_reason="length"))
    assert result.done and result.reward == 1.0


async def test_calls_run_in_order_and_their_results_go_back_as_tool_messages() -> None:
    env = await started()
    text = (
        "First " + CALL("write", {"number": 2}) + CALL("write", {"number": "3"}) + CALL("total", {})
    )
    result = await env.step(turn(text))
    assert not result.done and result.reward == 0.0
    assert result.observation == (
        {"role": "tool", "name": "write", "content": "kept 2"},
        {"role": "tool", "name": "write", "content": "kept 3"},
        {"role": "tool", "name": "total", "content": "5"},
    )
    metrics = result.metrics
    assert (
        metrics["tool_calls"] == 3 and metrics["tool_errors"] == 0 and metrics["parse_errors"] == 0
    )
    assert metrics["tool_calls/write"] == 2 and metrics["tool_calls/total"] == 1
    assert metrics["tool_s"] >= 0.01
    assert (await env.step(turn("5"))).reward == 1.0


async def test_hidden_arguments_come_from_the_environment_per_episode() -> None:
    env = await started()
    await env.step(turn(CALL("write", {"number": 1})))
    result = await env.step(turn(CALL("whisper", {})))
    assert result.observation[0]["content"] == "key-1"
    refused = await env.step(turn(CALL("whisper", {"secret": "mine"})))
    assert "unexpected argument 'secret'" in refused.observation[0]["content"]
    assert refused.metrics["tool_errors"] == 1


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (("fail", {"reason": "disk full"}), "Error: ValueError: disk full"),
        (("hang", {}), "Error: hang timed out after 0.02 s"),
        (("write", {"number": "two"}), "Error: invalid arguments for write: argument 'number'"),
        (("write", {}), "Error: invalid arguments for write: missing required argument 'number'"),
        (("erase", {"all": True}), "Error: there is no tool 'erase'; the tools are: write, total"),
    ],
)
async def test_a_failed_call_is_told_to_the_model_and_counted(
    call: tuple[str, dict[str, Any]], expected: str
) -> None:
    env = await started()
    result = await env.step(turn(CALL(*call)))
    assert not result.done
    (message,) = result.observation
    assert message["role"] == "tool" and message["name"] == call[0]
    assert message["content"].startswith(expected)
    assert "Traceback" not in message["content"]
    assert result.metrics["tool_calls"] == 1 and result.metrics["tool_errors"] == 1
    assert ("tool_calls/erase" in result.metrics) is False


async def test_malformed_calls_are_told_to_the_model_as_tool_messages_and_counted() -> None:
    env = await started()
    text = (
        CALL("write", {"number": 4})
        + '<tool_call>{"name": "write", "parameters": {"number": 1}}</tool_call>'
        + '<tool_call>{"name": "total", "arguments": {}'
    )
    result = await env.step(turn(text, finish_reason="length"))
    assert not result.done and result.reward == 0.0
    assert [m["content"] for m in result.observation[:1]] == ["kept 4"]
    parameters, truncated = result.observation[1:]
    assert parameters["role"] == "tool" and "name" not in parameters
    assert parameters["content"].startswith("Error: ") and '"parameters"' in parameters["content"]
    assert "no closing </tool_call>" in truncated["content"]
    assert result.metrics["parse_errors"] == 2 and result.metrics["tool_calls"] == 1


async def test_calls_over_the_per_turn_limit_are_refused_not_run() -> None:
    env = await started()
    text = "".join(CALL("write", {"number": n}) for n in range(5))
    result = await env.step(turn(text))
    assert env.numbers == [0, 1, 2]
    assert [m["content"] for m in result.observation[3:]] == [
        "Error: not run: at most 3 tool calls run per turn; make the others in your next turn"
    ] * 2
    assert result.metrics["tool_calls"] == 5 and result.metrics["tool_errors"] == 2


async def test_an_environment_failure_in_a_tool_aborts_the_episode() -> None:
    env = await started()
    with pytest.raises(EnvironmentFailure, match="sandbox died"):
        await env.step(turn(CALL("write", {"number": 1}) + CALL("crash", {})))


class Broken(Notebook):
    def hidden_arguments(self) -> dict[str, Any]:
        return {"secrte": "typo"}

    async def score(self, answer: str) -> float:
        return math.nan


async def test_environment_bugs_are_errors_not_messages() -> None:
    env = Broken()
    await env.reset(TASK)
    with pytest.raises(
        ToolDefinitionError, match=r"gives \['secrte'\], which no tool hides; tools hide: secret"
    ):
        await env.step(turn(CALL("total", {})))
    with pytest.raises(ToolEnvironmentError, match="score returned nan; return a finite number"):
        await env.step(turn("5"))


def test_tool_names_and_limits_are_checked_when_the_class_is_created() -> None:
    with pytest.raises(ToolDefinitionError, match="two tools named 'write'"):

        class Twice(Notebook):
            @tool(name="write")
            def scribble(self, number: int) -> str:
                """Also write."""
                return ""

    with pytest.raises(ToolDefinitionError, match="max_tool_calls_per_turn=0 must be at least 1"):

        class NoCalls(Notebook):
            max_tool_calls_per_turn = 0
