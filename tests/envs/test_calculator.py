"""The calculator example: safe arithmetic, deterministic tasks, exact scoring, and
demonstrations the environment itself would play out."""

import pytest

from dynarl.envs.calculator import (
    SYSTEM_PROMPT,
    CalculatorEnvironment,
    CalculatorTask,
    calculator_spec,
    demonstrations,
    evaluate,
    format_number,
)
from dynarl.envs.environment import Turn
from dynarl.envs.prompts import Prompt


def turn(text: str) -> Turn:
    return Turn(text=text, token_ids=(), finish_reason="stop", index=0)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347 * 29", 10063),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-(4 - 10) + +1", 7),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        (" 10 ** 18 ", 10**18),
    ],
)
def test_evaluate_does_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("__import__('os')", "Call is not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("().__class__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 << 70", "LShift is not allowed"),
        ("~5", "Invert is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("2 ** 100000", "too large"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 19", "too large"),
        ("10 ** 18 * 10", "out of range"),
        ("1e300", "out of range"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_evaluate_refuses_everything_but_bounded_arithmetic(expression: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        evaluate(expression)


def test_division_by_zero_is_an_error() -> None:
    with pytest.raises(ZeroDivisionError):
        evaluate("1 / (2 - 2)")
    with pytest.raises(ZeroDivisionError):
        evaluate("0 ** -1")


def test_numbers_print_without_needless_decimals() -> None:
    assert [format_number(v) for v in (10063, 5.0, 3.5, 1 / 3, -2.0)] == [
        "10063",
        "5",
        "3.5",
        "0.3333333333",
        "-2",
    ]


def test_tasks_are_a_pure_function_of_seed_and_index() -> None:
    task = CalculatorTask(seed=3)
    assert task.prompt(11) == CalculatorTask(seed=3).prompt(11)
    prompts = [task.prompt(i) for i in range(200)]
    assert prompts != [CalculatorTask(seed=4).prompt(i) for i in range(200)]
    assert len({p.text for p in prompts}) > 190
    assert {p.metadata["expression"].split()[1] for p in prompts} == {"+", "-", "*"}
    for p in prompts:
        expression = p.metadata["expression"]
        assert p.text == f"What is {expression}?"
        assert p.answer == str(evaluate(expression))
        assert p.prompt_id == f"calculator-3-{prompts.index(p)}"


async def started(task: Prompt) -> CalculatorEnvironment:
    env = CalculatorEnvironment()
    assert await env.reset(task) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.text},
    ]
    return env


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("10063", 1.0),
        ("347 * 29 = 10063", 1.0),
        ("The answer is 10,063.", 1.0),
        ("10063.0", 1.0),
        ("10063 is not 10064", 0.0),
        ("-10063", 0.0),
        ("I don't know", 0.0),
    ],
)
async def test_the_final_answers_last_number_is_scored(answer: str, reward: float) -> None:
    env = await started(Prompt(prompt_id="p", text="What is 347 * 29?", answer="10063"))
    result = await env.step(turn(answer))
    assert result.done and result.reward == reward


async def test_a_bad_expression_goes_back_to_the_model() -> None:
    env = await started(CalculatorTask().prompt(0))
    call = CalculatorEnvironment.parser.render("calculate", {"expression": "__import__('os')"})
    result = await env.step(turn(call))
    assert not result.done
    (message,) = result.observation
    assert message == {
        "role": "tool",
        "name": "calculate",
        "content": "Error: ValueError: Call is not allowed; use numbers, + - * / // % ** and "
        "parentheses",
    }
    assert result.metrics["tool_errors"] == 1


@pytest.mark.parametrize("index", range(5))
async def test_a_demonstration_is_what_the_environment_plays_and_earns_full_reward(
    index: int,
) -> None:
    task = CalculatorTask(seed=1).prompt(index)
    demo = demonstrations(task)
    assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant"]
    env = await started(task)
    assert demo[:2] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.text},
    ]
    called = await env.step(turn(demo[2]["content"]))
    assert called.observation == (demo[3],)
    assert called.metrics["tool_calls/calculate"] == 1 and called.metrics["tool_errors"] == 0
    answered = await env.step(turn(demo[4]["content"]))
    assert answered.done and answered.reward == 1.0
    assert demo[4]["content"] == task.answer


def test_the_spec_plays_the_calculator() -> None:
    spec = calculator_spec(seed=2)
    assert spec.name == "calculator"
    assert spec.task is not None and spec.task(7) == CalculatorTask(seed=2).prompt(7)
    assert spec.demonstrations is demonstrations
    env = spec.make()
    (schema,) = env.tools
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema["function"]["description"] == "Evaluate an arithmetic expression."
