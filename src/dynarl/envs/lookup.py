"""The tiny agentic task: read a code out of a box, which only a tool can open.

Each task asks for the code of one of ten boxes (``"box 3"``); the codes are random
three-digit numbers drawn per task, never shown to the policy: the only way to them is
the ``open_box`` tool, whose hidden episode argument holds them. So the reward — the
fraction of the code's digits the final answer gets right, in place — is reachable
only through the tool: guessing earns 0.1 per digit on average, calling the tool and
copying its output earns 1.

It is the environment of the ``agentic_tiny`` recipe, sized for a random-init model
with the built-in chat tokenizer: short prompts, one tool, one call. Its
demonstrations (for a supervised warm start) call the tool in half of the
episodes and guess in the rest, so a warm-started policy calls it sometimes, and RL
has to discover that calling pays.
"""

import json
import re
from typing import Any

import numpy as np

from dynarl.envs.environment import ChatMessage, EnvironmentSpec
from dynarl.envs.prompts import Prompt
from dynarl.envs.tool_env import ToolEnvironment
from dynarl.envs.tools import tool

NUM_BOXES = 10
"""Boxes per task (numbered 0-9)."""
SYSTEM_PROMPT = "Use open_box."
"""What the policy is told."""
CALL_FRACTION = 0.5
"""Share of the demonstrations that call the tool (the others guess)."""
GUESS = "000"
"""The demonstrations' guess: one fixed answer (random ones would only teach noise)."""

_CODE = re.compile(r"\d{3}")


class LookupTask:
    """The tasks of the lookup environment, a pure function of ``(seed, index)``."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        """Task ``index``: which box to read, the codes of all ten (hidden), and the
        answer."""
        rng = np.random.default_rng([self.seed, index, 0x10C])
        codes = [f"{int(c):03d}" for c in rng.integers(0, 1000, size=NUM_BOXES)]
        box = int(rng.integers(NUM_BOXES))
        return Prompt(
            prompt_id=f"lookup-{self.seed}-{index}",
            text=f"box {box}",
            answer=codes[box],
            metadata={"box": box, "codes": codes},
        )


class LookupEnvironment(ToolEnvironment):
    """One episode: ask for a box's code; ``open_box`` reveals it."""

    async def setup(self, task: Prompt) -> list[ChatMessage]:
        """The system prompt and the question."""
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.text},
        ]

    def hidden_arguments(self) -> dict[str, Any]:
        """The episode's codes, for ``open_box``."""
        return {"codes": list(self.task.metadata["codes"])}

    @tool(hidden=("codes",), timeout_s=1.0)
    def open_box(self, box: int, codes: list[str]) -> str:
        """Open a box and read its code.

        Args:
            box: the box's number, 0-9.
            codes: the episode's codes (hidden).
        """
        if not 0 <= box < len(codes):
            raise ValueError(f"there is no box {box}; boxes are 0-{len(codes) - 1}")
        return codes[box]

    async def score(self, answer: str) -> float:
        """Digits of the last three-digit number in ``answer`` that match the code."""
        found = _CODE.findall(answer)
        if not found:
            return 0.0
        code = self.task.answer or ""
        right = sum(a == b for a, b in zip(found[-1], code, strict=True))
        return float(right) / len(code)


def demonstrations(task: Prompt) -> list[ChatMessage]:
    """A worked episode of ``task``: a call of ``open_box`` and the code it reads (in
    :data:`CALL_FRACTION` of the tasks), or a guess."""
    index = int(task.prompt_id.rsplit("-", 1)[-1])
    rng = np.random.default_rng([index, 0xDE70])
    first: list[ChatMessage] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.text},
    ]
    if rng.random() >= CALL_FRACTION:
        return [*first, {"role": "assistant", "content": GUESS}]
    box = task.metadata["box"]
    arguments = json.dumps({"name": "open_box", "arguments": {"box": box}})
    call = f"<tool_call>{arguments}</tool_call>"
    return [
        *first,
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "open_box", "content": str(task.answer)},
        {"role": "assistant", "content": str(task.answer)},
    ]


def lookup_spec(seed: int = 0) -> EnvironmentSpec:
    """The lookup environment, its tasks from ``seed``, and its demonstrations."""
    return EnvironmentSpec(
        make=LookupEnvironment,
        task=LookupTask(seed).prompt,
        demonstrations=demonstrations,
        name="lookup",
    )
