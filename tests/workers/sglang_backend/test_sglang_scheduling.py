"""What the SGLang engine tells the scheduler and the data router: the prompt tokens a
server found in its prefix cache come back on the completion (the next turn of a
session reuses the previous one's context), the priority-aware order reaches the server
as SGLang's ``priority``, and the server's load is read at the configured rate."""

import anyio
import pytest

from dynarl.testing.fake_sglang import FakeSGLang
from dynarl.testing.sinks import RecordingSink
from dynarl.workers.rollout import GenerateRequest, SamplingParams

from .conftest import MODEL, running, until

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


async def test_a_next_turn_reports_the_previous_turns_context_as_cached(fake: FakeSGLang) -> None:
    async with running(fake) as engine:
        first = RecordingSink(raise_on_fail=True)
        turn = GenerateRequest(request_id="t0", prompt_ids=(5, 6, 7, 8), sampling=GREEDY)
        await engine.submit([turn], first)
        await first.wait_for(lambda: len(first.completions) == 1)
        done = first.completions["t0"]
        assert done.cached_tokens == 0
        context = done.prompt_ids + done.output_ids
        second = RecordingSink(raise_on_fail=True)
        follow = GenerateRequest(request_id="t1", prompt_ids=(*context, 9, 10), sampling=GREEDY)
        other = GenerateRequest(request_id="o1", prompt_ids=(11, 12, 13), sampling=GREEDY)
        await engine.submit([follow, other], second)
        await second.wait_for(lambda: len(second.completions) == 2)
    assert second.completions["t1"].cached_tokens == len(context)
    assert second.completions["o1"].cached_tokens == 0


@pytest.mark.parametrize(
    ("order", "served"),
    [
        ("priority", ["busy", "calls2", "calls1", "calls0"]),
        ("fifo", ["busy", "calls0", "calls2", "calls1"]),
    ],
)
async def test_the_priority_order_serves_requests_with_more_tool_calls_first(
    order: str, served: list[str]
) -> None:
    with FakeSGLang(MODEL, max_running_requests=1) as fake:
        async with running(fake, order=order) as engine:
            sink = RecordingSink(raise_on_fail=True)
            blocker = GenerateRequest(
                request_id="busy",
                prompt_ids=(3, 4),
                sampling=SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True),
            )
            await engine.submit([blocker], sink)
            await until(lambda: engine.load().num_running == 1)
            waiting = [
                GenerateRequest(
                    request_id=f"calls{n}", prompt_ids=(5, 6), tool_calls=n, sampling=GREEDY
                )
                for n in (0, 2, 1)
            ]
            for i, request in enumerate(waiting):  # one at a time: arrival order 0, 2, 1
                await engine.submit([request], sink)
                await until(lambda i=i: fake.engine.num_unfinished == 2 + i)
            await sink.wait_for(lambda: len(sink.completions) == 4)
    assert list(sink.completions) == served


async def test_the_servers_load_is_read_at_the_configured_rate(fake: FakeSGLang) -> None:
    """Polled every ``stats_interval_s``, never faster (the scheduler's donor test
    looks at seconds of history; a slot reports its engine's load every second)."""
    async with running(fake, stats_interval_s=0.1) as engine:
        started = anyio.current_time()
        await until(lambda: fake.num_load_calls >= 4)
        elapsed = anyio.current_time() - started
        assert fake.num_load_calls <= elapsed / 0.1 + 1
        assert engine.load().kv_tokens == 0
