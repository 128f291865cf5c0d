"""The rule-based verifier and running slow verifiers off the event loop."""

import threading
import time

import anyio
import pytest

from dynarl.envs.prompts import Prompt
from dynarl.envs.verifier import AsyncVerifier, MatchVerifier, VerifierError, score_all

PROMPT = Prompt(prompt_id="p", text="((((", answer="))))")


def test_match_verifier_gives_partial_credit() -> None:
    verify = MatchVerifier()
    assert verify(PROMPT, "))))") == 1.0
    assert verify(PROMPT, "") == pytest.approx(0.5 * 1 / 5)
    # Closer in length and content scores higher, from either side.
    assert verify(PROMPT, ")))") > verify(PROMPT, "))") > verify(PROMPT, ")")
    assert verify(PROMPT, ")))))") > verify(PROMPT, "))))))))")
    assert verify(PROMPT, "))))x") > verify(PROMPT, "xxxx") > verify(PROMPT, "xxxxxxxxxx")
    assert 0.0 <= verify(PROMPT, "abc" * 50) < 0.1
    with pytest.raises(VerifierError, match="no reference answer"):
        verify(Prompt(prompt_id="q", text="hi"), "x")


def test_score_all_checks_rewards() -> None:
    assert score_all(MatchVerifier(), [(PROMPT, "))))"), (PROMPT, "")]) == [1.0, 0.1]
    with pytest.raises(VerifierError, match=r"\[0, 1\]"):
        score_all(lambda p, r: 1.5, [(PROMPT, "")])
    with pytest.raises(VerifierError, match="finite"):
        score_all(lambda p, r: float("nan"), [(PROMPT, "")])


class SlowVerifier:
    """Sleeps in the calling thread (a blocking checker) and records concurrency."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()

    def __call__(self, prompt: Prompt, response: str) -> float:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        time.sleep(self.delay_s)
        with self.lock:
            self.running -= 1
        return 1.0 if response == prompt.answer else 0.0


async def test_slow_verifier_does_not_block_the_event_loop() -> None:
    slow = SlowVerifier(delay_s=0.15)
    runner = AsyncVerifier(slow, max_concurrency=2)
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        started = time.perf_counter()
        rewards = await runner.score_many([(PROMPT, "))))"), (PROMPT, "x")] * 3)
        elapsed = time.perf_counter() - started
        done.set()
    assert rewards == [1.0, 0.0] * 3
    # Six calls of 0.15 s, two at a time: about 0.45 s, during which the loop ticked.
    assert slow.max_running == 2
    assert elapsed >= 0.4
    assert ticks >= 15


async def test_async_verifier_checks_rewards() -> None:
    runner = AsyncVerifier(lambda p, r: -0.1)
    with pytest.raises(VerifierError, match="prompt 'p'"):
        await runner.score(PROMPT, "")
    with pytest.raises(VerifierError, match="at least 1"):
        AsyncVerifier(MatchVerifier(), max_concurrency=0)
