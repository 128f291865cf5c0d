"""The rollout role's contract (:class:`~dynarl.workers.rollout.RolloutEngine`), for
every rollout backend: completions carry tokens, log-probs, a finish reason and the
weight version; no more requests run at once than the engine announces; an abort
returns exactly the tokens generated so far, and another engine resumes them without
losing or repeating one; log-probs are what teacher forcing gives; memory is released
and resumed without changing the output; an ended multi-turn session leaves nothing
cached; weight versions travel with the weights; bad requests get a typed error and
queue nothing."""

import anyio
import msgspec
import numpy as np
import pytest

from dynarl.testing.ports import free_port
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.weights import WeightSyncGroup

from .conftest import MODEL, InferenceFactory, RecordingSink, RolloutFactory

TOKENIZER = build_tokenizer()
PROMPTS = ["hi", "What is 7*6?", "a", "The quick brown fox", "x=1;y=2", "Tell me"]


def greedy(
    max_new_tokens: int, *, prefix: str = "r", n: int = len(PROMPTS)
) -> list[GenerateRequest]:
    """Greedy requests that run exactly ``max_new_tokens`` tokens."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [
        GenerateRequest(
            request_id=f"{prefix}{i}", prompt_ids=tuple(TOKENIZER.encode(p)), sampling=sampling
        )
        for i, p in enumerate(PROMPTS[:n])
    ]


async def generate(engine: object, requests: list[GenerateRequest]) -> dict[str, Completion]:
    sink = RecordingSink()
    await engine.submit(requests, sink)  # type: ignore[attr-defined]
    await sink.wait_for(lambda: len(sink.completions) == len(requests))
    return sink.completions


def assert_same(got: dict[str, Completion], want: dict[str, Completion]) -> None:
    assert got.keys() == want.keys()
    for rid, c in got.items():
        assert c.output_ids == want[rid].output_ids, rid
        np.testing.assert_allclose(c.output_logprobs, want[rid].output_logprobs, atol=1e-4)


async def test_completions_carry_tokens_logprobs_finish_reason_and_version(
    rollout_factory: RolloutFactory,
) -> None:
    stop = GenerateRequest(
        request_id="s",
        prompt_ids=tuple(TOKENIZER.encode("hello")),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=200, seed=3),
    )
    async with rollout_factory() as engine:
        done = await generate(engine, [*greedy(12), stop])
        assert engine.num_requests == 0
    for rid, c in done.items():
        assert len(c.output_logprobs) == len(c.output_ids) > 0
        assert all(lp <= 0.0 for lp in c.output_logprobs)
        assert c.weight_version == engine.weight_version == 0
        assert c.prompt_ids
        if rid != "s":
            assert (len(c.output_ids), c.finish_reason) == (12, "length")
    assert done["s"].finish_reason in ("stop", "length")
    if done["s"].finish_reason == "stop":
        assert done["s"].output_ids[-1] == TOKENIZER.eos_token_id


async def test_abort_returns_exactly_the_tokens_so_far_and_another_engine_resumes_them(
    rollout_factory: RolloutFactory,
) -> None:
    long = greedy(64)
    async with rollout_factory() as reference:
        uninterrupted = await generate(reference, long)
    async with rollout_factory() as first, rollout_factory() as second:
        sink = RecordingSink()
        # Short requests in the same batch: once they finish, the long ones are halfway.
        await first.submit(long, sink)
        await first.submit(greedy(8, prefix="short"), sink)
        await sink.wait_for(lambda: len(sink.completions) >= len(PROMPTS))
        load = first.load()
        assert load.num_running > 0 and load.kv_tokens > 0
        taken = await first.abort([r.request_id for r in long])
        assert first.num_requests == 0
        assert {r.request_id for r in taken} == set(sink.taken) == {r.request_id for r in long}
        for request in taken:
            full = uninterrupted[request.request_id]
            so_far = len(request.output_ids)
            assert 0 < so_far < 64
            assert request.output_ids == full.output_ids[:so_far]
            np.testing.assert_allclose(
                request.output_logprobs, full.output_logprobs[:so_far], atol=1e-4
            )
            assert request.weight_version == 0
        resumed = await generate(second, list(taken))
    assert_same(resumed, uninterrupted)
    assert all(len(c.output_ids) == 64 for c in resumed.values())


async def test_an_engine_runs_no_more_requests_at_once_than_it_announces(
    rollout_factory: RolloutFactory,
) -> None:
    """What it says it runs at once is what its slot tells the data router: never
    less than what it really runs."""
    async with rollout_factory() as engine:
        limit = engine.max_running_requests
        requests = [
            msgspec.structs.replace(r, request_id=f"{r.request_id}-{k}")
            for k in range(limit // len(PROMPTS) + 2)
            for r in greedy(12)
        ]
        sink = RecordingSink()
        await engine.submit(requests, sink)
        peak = 0
        with anyio.fail_after(60):
            while len(sink.completions) < len(requests):
                peak = max(peak, engine.load().num_running)
                await anyio.sleep(0.002)
    assert len(requests) > limit
    assert 0 < peak <= limit


async def test_logprobs_match_teacher_forcing(
    rollout_factory: RolloutFactory, inference_factory: InferenceFactory
) -> None:
    sampled = [
        GenerateRequest(
            request_id=f"t{i}",
            prompt_ids=tuple(TOKENIZER.encode(p)),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=20, seed=10 + i),
        )
        for i, p in enumerate(PROMPTS)
    ]
    async with rollout_factory() as engine:
        done = await generate(engine, sampled)
    scorer = inference_factory()
    scored = await scorer.score(
        [
            LogprobRequest(
                item_id=c.request_id,
                token_ids=c.prompt_ids + c.output_ids,
                response_start=len(c.prompt_ids),
            )
            for c in done.values()
        ]
    )
    for result in scored:
        np.testing.assert_allclose(result.logprobs, done[result.item_id].output_logprobs, atol=1e-4)


async def test_released_memory_resumes_with_the_same_output(
    rollout_factory: RolloutFactory,
) -> None:
    async with rollout_factory() as engine:
        before = await generate(engine, greedy(10))
        sink = RecordingSink()
        await engine.release_memory(host_backup=True)
        await engine.submit(greedy(10, prefix="q"), sink)
        with anyio.move_on_after(0.5):
            await sink.wait_for(lambda: bool(sink.completions))
        assert not sink.completions, "an engine with its memory released generated"
        await engine.resume_memory()
        await sink.wait_for(lambda: len(sink.completions) == len(PROMPTS))
    assert_same({k.replace("q", "r"): v for k, v in sink.completions.items()}, before)


async def test_an_ended_session_leaves_nothing_cached(rollout_factory: RolloutFactory) -> None:
    """A multi-turn session's turn may leave its context cached for the next turn; once
    the session is over the engine holds nothing for it (an unknown id is ignored)."""
    turns = [msgspec.structs.replace(r, multi_turn=True) for r in greedy(6, n=2)]
    async with rollout_factory() as engine:
        await generate(engine, turns)
        await engine.end_sessions([turns[0].request_id, "never-seen"])
        await engine.end_sessions([turns[1].request_id])
        assert engine.load().cached_prefix_tokens == 0


async def test_bad_requests_get_a_typed_error_and_queue_nothing(
    rollout_factory: RolloutFactory,
) -> None:
    async with rollout_factory() as engine:
        sink = RecordingSink()
        good = greedy(4, n=2)
        await engine.submit(good[:1], sink)
        for bad in (
            [good[1], good[0]],  # one duplicate: neither is queued
            [msgspec.structs.replace(good[1], prompt_ids=())],
            [msgspec.structs.replace(good[1], prompt_ids=(5,) * MODEL.max_seq_len)],
            [msgspec.structs.replace(good[1], output_ids=(5, 6), output_logprobs=(-1.0,))],
        ):
            with pytest.raises(BadRequestError):
                await engine.submit(bad, sink)
        assert engine.num_requests <= 1
        await sink.wait_for(lambda: len(sink.completions) == 1)
        assert set(sink.completions) == {good[0].request_id}


async def test_weights_arrive_with_their_version(rollout_factory: RolloutFactory) -> None:
    """A sender (the trainer's side, here a seed-1 model in this process) broadcasts
    weights tagged 7: the engine takes them, and what it generates says so."""
    from dynarl.workers.torch import weight_sync
    from dynarl.workers.torch.model import build_model

    trained = build_model(MODEL, seed=1)
    port = free_port()
    group = WeightSyncGroup(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=30.0)

    manifest = weight_sync.manifest_of(trained, version=7, bucket_bytes=1 << 16)
    assert len(manifest.buckets) > 1

    def send() -> None:
        sender = weight_sync.join_weight_sync_group(
            host="127.0.0.1", port=port, rank=0, world_size=2, device=torch_cpu(), timeout_s=30.0
        )
        weight_sync.send_by_manifest(trained, manifest, group=sender)
        weight_sync.leave_weight_sync_group(sender)

    async with rollout_factory() as engine:
        before = await generate(engine, greedy(8))
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, send)
            await engine.join_weight_sync(group)
            assert await engine.receive_weights(manifest) == 7
            await engine.leave_weight_sync()
        assert engine.weight_version == 7
        after = await generate(engine, greedy(8, prefix="v"))
    assert {c.weight_version for c in after.values()} == {7}
    changed = [
        rid
        for rid, c in after.items()
        if c.output_logprobs != before["r" + rid[1:]].output_logprobs
    ]
    assert changed, "the engine generated with the old weights"


def torch_cpu() -> object:
    import torch

    return torch.device("cpu")
