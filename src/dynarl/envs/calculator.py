"""The calculator example: arithmetic questions, answered with a calculator tool.

The smallest complete tool environment, and a test bed for agentic RL: a task
``"What is 347 * 29?"``, a ``calculate`` tool that evaluates arithmetic safely, and a
reward of 1 when the final answer's last number is right. Tasks are a pure function
of ``(seed, index)`` (:class:`CalculatorTask`), and :func:`demonstrations` plays a
task perfectly, for a supervised warm start of a random-init policy before RL.
"""

import ast
import math
import operator
import re
from collections.abc import Callable

import numpy as np

from dynarl.envs.environment import ChatMessage, EnvironmentSpec
from dynarl.envs.prompts import Prompt
from dynarl.envs.tool_env import ToolEnvironment
from dynarl.envs.tools import tool

SYSTEM_PROMPT = "Use calculate, then reply with the number."
"""Short on purpose: a tiny character-level policy reads it every episode."""

MAX_EXPRESSION_CHARS = 200
"""Longest expression :func:`evaluate` reads."""
MAX_MAGNITUDE = 10**18
"""Largest absolute value of any number in an evaluation, given or computed."""

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``: numbers, ``+ - * / // % **``,
    parentheses and unary signs only, every number within :data:`MAX_MAGNITUDE`.

    The expression is parsed with :mod:`ast` and only those nodes are evaluated, so
    names, calls, attributes and everything else are refused before anything runs.
    Raises ``ValueError`` saying what is not allowed, ``ZeroDivisionError`` for a
    division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return _value(tree.body)


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        number = node.value
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ValueError(f"only numbers are allowed, not {number!r}")
        return _bounded(number)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    what = type(node.op if isinstance(node, ast.BinOp | ast.UnaryOp) else node).__name__
    raise ValueError(f"{what} is not allowed; use numbers, + - * / // % ** and parentheses")


def _check_power(base: float, exponent: float) -> None:
    """Refuse a power before computing it if its result would be out of bounds."""
    if base < 0 and not float(exponent).is_integer():
        raise ValueError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ValueError(f"{base} ** {exponent} is too large; results are at most 1e18")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("0 cannot be raised to a negative power")


def _bounded(number: float) -> int | float:
    if isinstance(number, complex) or not abs(number) <= MAX_MAGNITUDE:
        raise ValueError(f"{number} is out of range; numbers are at most 1e18 in size")
    return number


def format_number(value: float) -> str:
    """``value`` as the tool prints it: whole numbers without a decimal point."""
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if value.is_integer() else f"{value:.10g}"


class CalculatorTask:
    """The calculator's tasks: ``"What is a op b?"`` with ``op`` one of ``+ - *``.

    Args:
        seed: task ``i`` depends on ``(seed, i)`` only.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        """Task ``index``, its answer, and its expression as ``metadata["expression"]``."""
        rng = np.random.default_rng([self.seed, index])
        op = str(rng.choice(["+", "-", "*"]))
        if op == "*":
            a, b = int(rng.integers(12, 1000)), int(rng.integers(2, 100))
        else:
            a, b = int(rng.integers(100, 10000)), int(rng.integers(100, 10000))
        expression = f"{a} {op} {b}"
        return Prompt(
            prompt_id=f"calculator-{self.seed}-{index}",
            text=f"What is {expression}?",
            answer=format_number(evaluate(expression)),
            metadata={"expression": expression},
        )


class CalculatorEnvironment(ToolEnvironment):
    """Arithmetic questions with one tool, ``calculate``; the final answer's last
    number earns 1 if it is the task's answer, else 0."""

    async def setup(self, task: Prompt) -> list[ChatMessage]:
        """The system prompt and the question."""
        return _opening(task)

    async def score(self, answer: str) -> float:
        """1.0 if the last number in ``answer`` equals the task's answer, else 0.0."""
        numbers = _NUMBER.findall(answer.replace(",", ""))
        expected = self.task.answer
        if not numbers or expected is None:
            return 0.0
        return 1.0 if float(numbers[-1]) == float(expected) else 0.0

    @tool(timeout_s=1.0, max_output_chars=200)
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(2 + 3) * 4".
        """
        return format_number(evaluate(expression))


def demonstrations(task: Prompt) -> list[ChatMessage]:
    """A perfect episode of ``task`` (one from :class:`CalculatorTask`): the opening
    messages, a call to ``calculate`` on the task's expression, the tool's answer,
    then the number as the final answer."""
    expression = str(task.metadata["expression"])
    result = format_number(evaluate(expression))
    call = CalculatorEnvironment.parser.render("calculate", {"expression": expression})
    return [
        *_opening(task),
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "calculate", "content": result},
        {"role": "assistant", "content": result},
    ]


def calculator_spec(seed: int = 0) -> EnvironmentSpec:
    """The calculator environment, its tasks from ``seed`` and its demonstrations."""
    return EnvironmentSpec(
        make=CalculatorEnvironment,
        task=CalculatorTask(seed).prompt,
        demonstrations=demonstrations,
        name="calculator",
    )


def _opening(task: Prompt) -> list[ChatMessage]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.text}]
