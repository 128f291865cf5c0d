"""The Python-code example: deterministic tasks with hidden tests, a run_python tool
backed by the sandbox, and a reward that is the fraction of hidden tests passed, which
code misbehaving in the sandbox can neither escape nor fake."""

from collections.abc import Iterator

import msgspec
import pytest

from dynarl.envs.environment import EnvironmentFailure, Turn
from dynarl.envs.prompts import Prompt
from dynarl.envs.python_tests import (
    SYSTEM_PROMPT,
    PythonTestsEnvironment,
    PythonTestsTask,
    demonstrations,
    final_code,
    python_tests_spec,
    run_hidden_tests,
)
from dynarl.envs.sandbox import PythonSandbox, SandboxLimits

TASKS = PythonTestsTask(seed=0)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[PythonSandbox]:
    yield PythonSandbox(SandboxLimits(timeout_s=1.5, cpu_s=2, memory_bytes=256 << 20))


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text=text, token_ids=(), finish_reason="stop", index=index)


def task_for(function: str) -> Prompt:
    """The first task of seed 0 that asks for ``function``."""
    for index in range(500):
        task = TASKS.prompt(index)
        if task.metadata["function"] == function:
            return task
    raise AssertionError(f"no task asks for {function}")


def answer(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```"


async def final_reward(sandbox: PythonSandbox, task: Prompt, text: str) -> float:
    env = PythonTestsEnvironment(sandbox)
    await env.reset(task)
    result = await env.step(turn(text))
    assert result.done and result.observation == ()
    await env.close()
    return result.reward


def test_tasks_are_a_pure_function_of_seed_and_index() -> None:
    assert PythonTestsTask(seed=3).prompt(7) == PythonTestsTask(seed=3).prompt(7)
    assert PythonTestsTask(seed=3).prompt(7) != PythonTestsTask(seed=4).prompt(7)
    tasks = [TASKS.prompt(i) for i in range(300)]
    assert len({t.prompt_id for t in tasks}) == 300
    assert len({str(t.metadata["function"]) for t in tasks}) == 13  # every template appears
    for task in tasks:
        assert len(task.metadata["tests"]) == 8
        assert task.text.startswith(f"Write `{task.metadata['function']}(")
        assert (
            msgspec.json.decode(msgspec.json.encode(task), type=Prompt) == task
        )  # a file keeps it


async def test_the_reference_solution_of_every_template_scores_1(sandbox: PythonSandbox) -> None:
    firsts: dict[str, Prompt] = {}
    for i in range(300):
        firsts.setdefault(str(TASKS.prompt(i).metadata["function"]), TASKS.prompt(i))
    rewards = {
        name: await final_reward(sandbox, task, answer(str(task.answer)))
        for name, task in firsts.items()
    }
    assert rewards == dict.fromkeys(firsts, 1.0)


async def test_a_wrong_answer_scores_less_and_partly_right_scores_in_between(
    sandbox: PythonSandbox,
) -> None:
    task = task_for("collatz_steps")  # tests: 1, 2, 27, then five numbers above 2
    assert await final_reward(sandbox, task, answer("def collatz_steps(n):\n    return 0")) == 1 / 8
    fails_big = "def collatz_steps(n):\n    assert n < 3\n    return n - 1"
    assert await final_reward(sandbox, task, answer(fails_big)) == 2 / 8
    assert await final_reward(sandbox, task, answer("def other(n):\n    return 0")) == 0.0
    assert await final_reward(sandbox, task, "collatz_steps is easy, it returns 0.") == 0.0


async def test_outputs_must_have_the_expected_type(sandbox: PythonSandbox) -> None:
    task = task_for("is_palindrome")
    as_int = "def is_palindrome(text):\n    kept = [c.lower() for c in text if c.isalnum()]\n"
    as_int += "    return int(kept == kept[::-1])"
    assert await final_reward(sandbox, task, answer(as_int)) == 0.0
    tuples = task_for("rotate")
    code = str(tuples.answer).replace(
        "return items[k:] + items[:k]", "return tuple(items[k:] + items[:k])"
    )
    code = code.replace("return []", "return ()")
    assert await final_reward(sandbox, tuples, answer(code)) == 1.0  # a tuple counts as a list


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import os\nwhile True:\n    os.fork()",
        "while True:\n    print('x' * 1000)",
        "import sys\nwhile True:\n    sys.stderr.write('x' * 1000)",
        "x = bytearray(10**10)",
        "import os\nos._exit(0)",
    ],
    ids=["hang", "fork", "flood-stdout", "flood-stderr", "memory", "exit"],
)
async def test_misbehaving_code_scores_0_and_the_environment_goes_on(
    sandbox: PythonSandbox, code: str
) -> None:
    task = task_for("digit_sum")
    assert await final_reward(sandbox, task, answer(code)) == 0.0
    assert await final_reward(sandbox, task, answer(str(task.answer))) == 1.0


async def test_a_function_that_hangs_on_one_input_keeps_the_tests_before_it(
    sandbox: PythonSandbox,
) -> None:
    task = task_for("digit_sum")  # tests: 0, 7, -45, then five random numbers
    code = str(task.answer).replace(
        "    n = abs(n)\n", "    n = abs(n)\n    while n == 45:\n        pass\n"
    )
    report = await run_hidden_tests(sandbox, code, task)
    assert (report.num_passed, report.num_tests) == (2, 8) and report.run.timed_out
    assert report.failures[0].startswith("digit_sum(-45) failed: timed out after 1.5 s")


async def test_reports_forged_inside_the_sandbox_earn_only_what_their_values_earn(
    sandbox: PythonSandbox,
) -> None:
    task = task_for("collatz_steps")  # expected outputs: 0 once, then all positive
    forge = (
        "import json, os, sys\n"
        "report = sys._getframe(1).f_globals['report']  # the scoring program's own\n"
        "for i in range(8):\n"
        "    report(i, 'ok', 0)\n"
        "    print(json.dumps(['nonce', i, 'ok', 0]))\n"
        "os._exit(0)\n"
    )
    assert await final_reward(sandbox, task, answer(forge)) == 1 / 8


async def test_run_python_runs_code_and_answers_with_its_output(sandbox: PythonSandbox) -> None:
    env = PythonTestsEnvironment(sandbox)
    task = task_for("digit_sum")
    messages = await env.reset(task)
    assert messages == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.text},
    ]
    assert [t["function"]["name"] for t in env.tools] == ["run_python"]
    call = env.parser.render("run_python", {"code": "print(sum(map(int, str(4096))))"})
    result = await env.step(turn(call))
    assert not result.done and result.reward == 0.0
    assert result.observation == (
        {"role": "tool", "name": "run_python", "content": "exited with code 0\n--- stdout ---\n19"},
    )
    assert result.metrics["tool_calls/run_python"] == 1.0 and result.metrics["tool_errors"] == 0.0
    crash = env.parser.render("run_python", {"code": "import os\nprint(os.listdir('/'))"})
    refused = await env.step(turn(crash, index=1))
    content = refused.observation[0]["content"]
    assert content.startswith("exited with code 1: refused by the sandbox: os.listdir of '/'")
    assert "--- stderr ---\nTraceback" in content
    final = await env.step(turn(answer(str(task.answer)), index=2))
    assert final.done and final.reward == 1.0
    await env.close()


async def test_a_demonstration_is_what_the_environment_plays_and_earns_full_reward(
    sandbox: PythonSandbox,
) -> None:
    for index in range(3):
        task = TASKS.prompt(index)
        conversation = demonstrations(task)
        env = PythonTestsEnvironment(sandbox)
        assert await env.reset(task) == conversation[:2]
        played = await env.step(turn(conversation[2]["content"]))
        assert list(played.observation) == [conversation[3]]
        final = await env.step(turn(conversation[4]["content"], index=1))
        assert final.done and final.reward == 1.0
        assert final_code(conversation[4]["content"]) == task.answer


async def test_a_sandbox_that_cannot_run_is_an_environment_failure() -> None:
    broken = PythonSandbox(isolation="rlimits", python="/nonexistent/python3")
    env = PythonTestsEnvironment(broken)
    await env.reset(task_for("digit_sum"))
    with pytest.raises(EnvironmentFailure):
        await env.step(turn(env.parser.render("run_python", {"code": "print(1)"})))
    with pytest.raises(EnvironmentFailure):
        await env.step(turn(answer("def digit_sum(n):\n    return 0")))


def test_the_final_code_is_the_last_fenced_block() -> None:
    assert final_code("no code here") is None
    assert final_code("```python\na = 1\n```\nthen\n```py\nb = 2\n```") == "b = 2\n"
    assert final_code("```\nc = 3\n```") == "c = 3\n"


def test_the_spec_plays_the_tasks_of_its_seed_in_a_shared_sandbox() -> None:
    spec = python_tests_spec(5)
    assert spec.name == "python-tests" and spec.demonstrations is demonstrations
    assert spec.task is not None and spec.task(4) == PythonTestsTask(seed=5).prompt(4)
    first, second = spec.make(), spec.make()
    assert isinstance(first, PythonTestsEnvironment) and isinstance(second, PythonTestsEnvironment)
    assert first is not second and first.sandbox is second.sandbox
