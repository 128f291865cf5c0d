"""The Python-code example: write a small function, try code in a sandbox, pass hidden tests.

A task asks for one function (``"Write `digit_sum(n: int) -> int`: the sum of the
digits of n written in base 10..."``), drawn from a dozen parametrised templates; its
hidden unit tests (inputs and expected outputs) travel in the prompt's ``metadata``.
The policy may call ``run_python(code)`` to run any program in the
:class:`~dynarl.envs.sandbox.PythonSandbox` and read its summary, stdout and stderr.
Its final answer, a turn without a tool call, must hold the function in a fenced code
block (```` ```python ... ``` ````, the last one counts); the reward is the
**fraction of the hidden tests it passes** (0 without a code block), so partly right
code earns partial credit within a group of samples.

Scoring cannot be fooled from inside the sandbox: the sandboxed harness only reports
what the function returned for each input (on a descriptor of its own, the code's
prints go to ``/dev/null``); the expected outputs never enter the sandbox and are
compared by this process, type for type (``True`` is not ``1``, ``6.0`` is not ``6``;
a tuple counts as a list). Code that hangs, forks, floods or crashes scores what its
tests reported before that: 0 when the code fails at import. A sandbox that cannot run
at all raises :class:`~dynarl.envs.environment.EnvironmentFailure`: the episode is
aborted, not scored.

Tasks are a pure function of ``(seed, index)`` (:class:`PythonTestsTask`); the
expected outputs come from the template's reference solution, run in this process
(it is this module's own code), which :func:`demonstrations` also plays.
"""

import functools
import json
import re
import secrets
from collections.abc import Callable, Sequence
from string import Template
from typing import Any

import msgspec
import numpy as np

from dynarl.envs._python_templates import TEMPLATES
from dynarl.envs.environment import ChatMessage, EnvironmentSpec
from dynarl.envs.prompts import Prompt
from dynarl.envs.sandbox import PythonSandbox, SandboxLimits, SandboxResult
from dynarl.envs.tool_env import ToolEnvironment
from dynarl.envs.tools import tool

SYSTEM_PROMPT = (
    "Write the Python function asked for. You may test code with run_python. "
    "Reply with the final function in a ```python code block."
)
"""What the policy is told every episode."""

DEFAULT_LIMITS = SandboxLimits(
    timeout_s=5.0,
    cpu_s=5,
    memory_bytes=512 << 20,
    max_file_bytes=4 << 20,
    max_output_bytes=16 << 10,
)
"""Each ``run_python`` call and each scoring run gets these (they are the tool's only
timeout, so the model reads the sandbox's own summary of what happened)."""

MAX_TOOL_OUTPUT_CHARS = 4000
"""A ``run_python`` answer (summary, stdout, stderr) is cut to this many characters."""

_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MAX_REPORTED_CHARS = 4000


_HARNESS = Template("""\
import json, os
out = os.dup(1)
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
os.dup2(quiet, 2)


def report(index, status, value):
    line = json.dumps([$nonce, index, status, value])
    if len(line) > $max_chars:
        line = json.dumps([$nonce, index, "error", "the value is too large to report"])
    os.write(out, (line + "\\n").encode())


try:
    namespace = {"__name__": "solution"}
    exec(compile($source, "solution.py", "exec"), namespace)
    function = namespace[$name]
except BaseException as exc:
    report(-1, "error", f"{type(exc).__name__}: {exc}"[:300])
    raise SystemExit(1)
for index, args in enumerate(json.loads($inputs)):
    try:
        report(index, "ok", function(*args))
    except BaseException as exc:
        report(index, "error", f"{type(exc).__name__}: {exc}"[:300])
""")
"""The scoring program: the candidate's code, then each hidden input; it reports only
what the function returned, on a descriptor of its own, tagged with a nonce."""


class ScoringReport(msgspec.Struct, frozen=True, kw_only=True):
    """How a candidate did on a task's hidden tests.

    Attributes:
        num_passed: tests whose output equalled the expected one.
        num_tests: the task's hidden tests.
        failures: one line per failed test: its call and what went wrong.
        run: the sandbox run of the scoring program.
    """

    num_passed: int
    num_tests: int
    failures: tuple[str, ...]
    run: SandboxResult

    @property
    def fraction(self) -> float:
        """Share of the tests passed: the reward."""
        return self.num_passed / self.num_tests if self.num_tests else 0.0


class PythonTestsTask:
    """The tasks: one function to write, from one of a dozen parametrised templates.

    Args:
        seed: task ``i`` depends on ``(seed, i)`` only.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        """Task ``index``: its text (with one worked example), the reference solution
        as ``answer``, and in ``metadata`` the ``function`` name, the template's
        ``params`` and the hidden ``tests`` (``[{"args": [...], "expected": ...}]``)."""
        rng = np.random.default_rng([self.seed, index])
        template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        params = template.params(rng)
        name = Template(template.name).substitute(params)
        solution = Template(template.solution).substitute(params)
        reference = _reference(solution, name)
        tests = [
            {"args": args, "expected": reference(*json.loads(json.dumps(args)))}
            for args in template.inputs(rng)
        ]
        example = tests[-1]
        signature = Template(template.signature).substitute(params)
        description = Template(template.description).substitute(params)
        text = (
            f"Write `{signature}`: {description}. For example, "
            f"{_call(name, example['args'])} returns {example['expected']!r}."
        )
        return Prompt(
            prompt_id=f"python-tests-{self.seed}-{index}",
            text=text,
            answer=solution,
            metadata={"function": name, "params": params, "tests": tests},
        )


class PythonTestsEnvironment(ToolEnvironment):
    """Write the function a task asks for; ``run_python`` runs code in the sandbox; the
    final answer's last code block earns the fraction of the hidden tests it passes.

    Args:
        sandbox: where code runs (share one across episodes: it checks the interpreter
            and bwrap once); default: a new one with :data:`DEFAULT_LIMITS`.
    """

    def __init__(self, sandbox: PythonSandbox | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else PythonSandbox(DEFAULT_LIMITS)

    async def setup(self, task: Prompt) -> list[ChatMessage]:
        """The system prompt and the task."""
        return _opening(task)

    async def score(self, answer: str) -> float:
        """The fraction of the hidden tests the last code block of ``answer`` passes
        (0.0 without a code block)."""
        code = final_code(answer)
        if code is None:
            return 0.0
        return (await run_hidden_tests(self.sandbox, code, self.task)).fraction

    @tool(max_output_chars=MAX_TOOL_OUTPUT_CHARS + 100)
    async def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox and see how it ended and what it printed.

        Args:
            code: the whole program; print what you want to see. It has no network,
                no subprocesses and no files but its own, and is stopped after a few
                seconds.
        """
        return (await self.sandbox.run(code)).transcript(MAX_TOOL_OUTPUT_CHARS)


def final_code(answer: str) -> str | None:
    """The last fenced code block of ``answer`` (```` ```python ````, ```` ```py ```` or
    bare ```` ``` ````), or ``None`` if it has none."""
    blocks = _CODE_BLOCK.findall(answer)
    return str(blocks[-1]) if blocks else None


async def run_hidden_tests(sandbox: PythonSandbox, code: str, task: Prompt) -> ScoringReport:
    """Run ``code`` against ``task``'s hidden tests in ``sandbox``, in one program, and
    compare what it returned with the expected outputs here."""
    name = str(task.metadata["function"])
    tests: list[dict[str, Any]] = list(task.metadata["tests"])
    nonce = secrets.token_hex(8)
    program = _HARNESS.substitute(
        nonce=repr(nonce),
        max_chars=_MAX_REPORTED_CHARS,
        source=repr(code),
        name=repr(name),
        inputs=repr(json.dumps([t["args"] for t in tests])),
    )
    run = await sandbox.run(program)
    reported = _reported(run.stdout, nonce)
    failures = []
    for index, test in enumerate(tests):
        status, value = reported.get(index, reported.get(-1, ("error", run.summary)))
        if status == "ok" and _same(value, test["expected"]):
            continue
        got = f"returned {value!r}" if status == "ok" else f"failed: {value}"
        failures.append(f"{_call(name, test['args'])} {got}, expected {test['expected']!r}")
    return ScoringReport(
        num_passed=len(tests) - len(failures),
        num_tests=len(tests),
        failures=tuple(failures),
        run=run,
    )


def demonstrations(task: Prompt) -> list[ChatMessage]:
    """A worked episode of ``task`` (one from :class:`PythonTestsTask`): the opening
    messages, a ``run_python`` call trying the reference solution on two of the tests,
    the sandbox's answer, then the solution in a code block as the final answer."""
    solution, name = str(task.answer), str(task.metadata["function"])
    tried = list(task.metadata["tests"])[-2:]
    code = solution + "\n" + "".join(f"print(repr({_call(name, t['args'])}))\n" for t in tried)
    printed = "".join(f"{t['expected']!r}\n" for t in tried)
    answer = SandboxResult(
        exit_code=0,
        stdout=printed,
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        timed_out=False,
        killed_by=None,
        duration_s=0.0,
        summary="exited with code 0",
        isolation="rlimits+audit",
    ).transcript(MAX_TOOL_OUTPUT_CHARS)
    return [
        *_opening(task),
        {
            "role": "assistant",
            "content": PythonTestsEnvironment.parser.render("run_python", {"code": code}),
        },
        {"role": "tool", "name": "run_python", "content": answer},
        {"role": "assistant", "content": f"```python\n{solution}```"},
    ]


def python_tests_spec(seed: int = 0, *, sandbox: PythonSandbox | None = None) -> EnvironmentSpec:
    """The Python-tests environment, its tasks from ``seed`` and its demonstrations;
    its episodes share ``sandbox`` (default: one with :data:`DEFAULT_LIMITS`)."""
    shared = sandbox if sandbox is not None else PythonSandbox(DEFAULT_LIMITS)
    return EnvironmentSpec(
        make=functools.partial(PythonTestsEnvironment, shared),
        task=PythonTestsTask(seed).prompt,
        demonstrations=demonstrations,
        name="python-tests",
    )


def _opening(task: Prompt) -> list[ChatMessage]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.text}]


def _reference(solution: str, name: str) -> Callable[..., Any]:
    """The function a reference solution (this module's own code) defines."""
    namespace: dict[str, Any] = {}
    exec(compile(solution, f"<reference {name}>", "exec"), namespace)
    return namespace[name]  # type: ignore[no-any-return]


def _call(name: str, args: Sequence[Any]) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def _reported(stdout: str, nonce: str) -> dict[int, tuple[str, Any]]:
    """The scoring program's reports by test index (-1: the code did not load); the
    first report of an index counts."""
    reports: dict[int, tuple[str, Any]] = {}
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, list)
            and len(record) == 4
            and record[0] == nonce
            and isinstance(record[1], int)
            and isinstance(record[2], str)
        ):
            reports.setdefault(record[1], (record[2], record[3]))
    return reports


def _same(got: Any, expected: Any) -> bool:
    """Equal and of the same types throughout (``True`` is not ``1``)."""
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(_same(g, e) for g, e in zip(got, expected, strict=True))
        )
    return type(got) is type(expected) and bool(got == expected)
