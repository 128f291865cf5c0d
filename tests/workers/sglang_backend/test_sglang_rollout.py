"""The SGLang adapter against a fake SGLang server: sampled requests resume on
another server exactly where they stopped, both streaming formats decode alike, a
server dying mid-generation hands its requests back with their output so far, 5xx
answers are retried and counted, and a server of another version is refused."""

import numpy as np
import pytest

from dynarl.testing.fake_sglang import FakeSGLang
from dynarl.testing.sinks import RecordingSink
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.sglang.backend import connect
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.errors import ProtocolMismatchError

from .conftest import MODEL, running, until


def sampled(n: int = 4, *, max_new_tokens: int = 40, prefix: str = "q") -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"{prefix}{i}",
            prompt_ids=(3 + i, 17, 29, 41),
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, seed=100 + i
            ),
        )
        for i in range(n)
    ]


async def test_a_sampled_request_aborted_and_resumed_elsewhere_matches_an_uninterrupted_one(
    fake: FakeSGLang,
) -> None:
    async with running(fake) as engine:
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(sampled(), sink)
        await sink.wait_for(lambda: len(sink.completions) == 4)
        uninterrupted = sink.completions
    with FakeSGLang(MODEL) as first, FakeSGLang(MODEL) as second:
        async with running(first) as a, running(second) as b:
            sink = RecordingSink(raise_on_fail=True)
            await a.submit(sampled(), sink)
            await until(
                lambda: (
                    a.load().num_running == 4
                    and sum(len(live.token_ids) for live in a._live.values()) >= 20
                )
            )
            taken = await a.abort(None)
            assert a.num_requests == 0 and len(taken) == 4
            for request in taken:
                full = uninterrupted[request.request_id]
                so_far = len(request.output_ids)
                assert 0 < so_far < 40
                assert request.output_ids == full.output_ids[:so_far]
            resumed = RecordingSink(raise_on_fail=True)
            await b.submit(taken, resumed)
            await resumed.wait_for(lambda: len(resumed.completions) == 4)
    for rid, c in resumed.completions.items():
        assert c.output_ids == uninterrupted[rid].output_ids
        np.testing.assert_allclose(c.output_logprobs, uninterrupted[rid].output_logprobs, atol=1e-4)


async def test_incremental_streaming_output_gives_the_same_completions(fake: FakeSGLang) -> None:
    async with running(fake) as engine:
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(sampled(2), sink)
        await sink.wait_for(lambda: len(sink.completions) == 2)
    with FakeSGLang(MODEL, incremental_streaming_output=True) as incremental:
        async with running(incremental) as engine:
            other = RecordingSink(raise_on_fail=True)
            await engine.submit(sampled(2), other)
            await other.wait_for(lambda: len(other.completions) == 2)
    for rid, c in other.completions.items():
        assert c.output_ids == sink.completions[rid].output_ids
        assert len(c.output_logprobs) == len(c.output_ids) == 40


async def test_a_server_dying_mid_generation_hands_its_requests_back_with_their_output(
    fake: FakeSGLang,
) -> None:
    async with running(fake, max_retries=0) as engine:
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(sampled(3, max_new_tokens=80), sink)
        await until(lambda: min((len(v.token_ids) for v in engine._live.values()), default=0) >= 5)
        fake.die()
        await sink.wait_for(lambda: len(sink.taken) == 3)
        assert engine.error is not None
        assert not sink.completions
        assert all(len(r.output_ids) >= 5 for r in sink.taken.values())
        assert all(len(r.output_logprobs) == len(r.output_ids) for r in sink.taken.values())
        await until(lambda: engine.num_requests == 0)
    with FakeSGLang(MODEL) as healthy:
        async with running(healthy) as other:
            resumed = RecordingSink(raise_on_fail=True)
            await other.submit(list(sink.taken.values()), resumed)
            await resumed.wait_for(lambda: len(resumed.completions) == 3)
    assert all(len(c.output_ids) == 80 for c in resumed.completions.values())
    for rid, c in resumed.completions.items():
        assert c.output_ids[: len(sink.taken[rid].output_ids)] == sink.taken[rid].output_ids


async def test_5xx_answers_are_retried_with_back_off_and_counted(fake: FakeSGLang) -> None:
    async with running(fake, retry_backoff_s=0.01, max_retries=3) as engine:
        fake.fail_next = [503, 502]
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(sampled(1, max_new_tokens=5), sink)
        await sink.wait_for(lambda: len(sink.completions) == 1)
    assert engine.num_retries == 2
    assert fake.num_generate_calls == 3


@pytest.mark.parametrize("version", ["0.4.9", "0.5.5.post3"])
def test_a_server_of_another_version_is_refused_at_start_up(version: str) -> None:
    with (
        FakeSGLang(MODEL, version=version) as old,
        pytest.raises(ProtocolMismatchError, match=rf"{version}.*0\.5\.x from 0\.5\.6"),
    ):
        connect(SGLangConfig(urls=(old.url,)), url=old.url, name="slot-0", max_running_requests=8)


async def test_load_reports_running_requests_and_their_kv_tokens(fake: FakeSGLang) -> None:
    async with running(fake, stats_interval_s=0.05) as engine:
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(sampled(3, max_new_tokens=80), sink)
        await until(lambda: engine.load().num_running == 3)
        load = engine.load()
        assert load.kv_tokens >= 3 * 5 and 0 < load.kv_usage < 1
        await sink.wait_for(lambda: len(sink.completions) == 3)
        assert engine.load().num_running == 0 and engine.load().gen_tokens_per_s > 0
