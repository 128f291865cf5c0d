"""The reference rollout engine on a real tiny model: continuous batching, log-probs a
trainer can trust, abort and resume, request order, weights and memory."""

import msgspec
import pytest
import torch
from transformers import PreTrainedModel

from dynarl.api.config import ModelConfig, RolloutConfig
from dynarl.core.clock import ManualClock
from dynarl.data.request_order import ToolCallPriorityOrder
from dynarl.data.request_queue import RequestQueue
from dynarl.workers.errors import BadRequestError, WeightSyncError
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams, TokenDelta
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.logprobs import sequence_logprobs
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER = build_tokenizer()
PROMPTS = ["hi", "What is 7*6?", "a", "The quick brown fox jumps", "x=1;y=2", "Tell me"]


def _engine(model: PreTrainedModel, **kwargs: object) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=TOKENIZER.eos_token_id, **kwargs)  # type: ignore[arg-type]


def _requests(
    temperature: float = 1.0, max_new_tokens: int = 24, **sampling: object
) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"r{i}",
            prompt_ids=tuple(TOKENIZER.encode(prompt)),
            sampling=SamplingParams(
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                seed=100 + i,
                **sampling,  # type: ignore[arg-type]
            ),
        )
        for i, prompt in enumerate(PROMPTS)
    ]


def _by_id(completions: list[Completion]) -> dict[str, Completion]:
    return {c.request_id: c for c in completions}


def _assert_same(got: dict[str, Completion], expected: dict[str, Completion]) -> None:
    """Same requests, tokens and finish reasons; log-probs equal up to float noise (a
    re-prefill computes them with other matrix shapes than incremental decoding)."""
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        assert (got[rid].output_ids, got[rid].finish_reason) == (
            want.output_ids,
            want.finish_reason,
        ), rid
        assert torch.allclose(
            torch.tensor(got[rid].output_logprobs),
            torch.tensor(want.output_logprobs),
            atol=1e-4,
            rtol=0,
        )


def _assert_teacher_forced(model: PreTrainedModel, completions: list[Completion]) -> None:
    forced = sequence_logprobs(
        model,
        [c.prompt_ids + c.output_ids for c in completions],
        starts=[len(c.prompt_ids) for c in completions],
    )
    for completion, expected in zip(completions, forced, strict=True):
        got = torch.tensor(completion.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), completion.request_id


def test_logprobs_match_a_teacher_forced_forward_under_continuous_batching(
    model: PreTrainedModel,
) -> None:
    engine = _engine(model, max_running_requests=3, kv_capacity_tokens=256)
    requests = _requests(1.0, top_p=0.9) + [
        msgspec.structs.replace(r, request_id=f"late-{r.request_id}") for r in _requests(0.7)
    ]
    completions: list[Completion] = []
    for request in requests:  # arrivals interleaved with steps
        engine.add_request(request)
        completions += [o for o in engine.step() if isinstance(o, Completion)]
        assert engine.stats().num_running <= 3
    while engine.num_unfinished:
        completions += [o for o in engine.step() if isinstance(o, Completion)]
    assert sorted(c.request_id for c in completions) == sorted(r.request_id for r in requests)
    assert all(c.weight_version == 0 for c in completions)
    _assert_teacher_forced(model, completions)


def test_a_request_samples_the_same_tokens_alone_or_in_a_batch(model: PreTrainedModel) -> None:
    alone = _engine(model).generate(_requests(1.0)[3:4])[0]
    batched = _by_id(_engine(model).generate(_requests(1.0)))["r3"]
    assert batched.output_ids == alone.output_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_abort_and_resume_elsewhere_matches_an_uninterrupted_run(
    model: PreTrainedModel, temperature: float
) -> None:
    expected = _by_id(_engine(model).generate(_requests(temperature)))

    first = _engine(model, max_running_requests=4)
    for request in _requests(temperature):
        first.add_request(request)
    for _ in range(6):
        first.step()
    partial = first.abort()
    assert first.num_unfinished == 0 and first.stats().kv_usage == 0.0
    assert len(partial) == len(PROMPTS)
    assert {len(p.output_ids) > 0 for p in partial} == {True, False}  # running and queued
    for p in partial:
        assert p.output_ids == expected[p.request_id].output_ids[: len(p.output_ids)]

    _assert_same(_by_id(_engine(model, seed=1).generate(partial)), expected)


def test_preemption_under_a_small_kv_budget_changes_no_output(model: PreTrainedModel) -> None:
    requests = _requests(0.0, max_new_tokens=40)
    expected = _by_id(_engine(model, max_seq_len=64).generate(requests))
    tight = _engine(model, kv_capacity_tokens=80, max_seq_len=64)
    for request in requests:
        tight.add_request(request)
    completions: list[Completion] = []
    num_preemptions = 0
    while tight.num_unfinished:
        queued = tight.stats().num_queued
        completions += [o for o in tight.step() if isinstance(o, Completion)]
        num_preemptions += tight.stats().num_queued > queued
        assert tight.stats().kv_usage <= 1.0
    assert num_preemptions > 0
    _assert_same(_by_id(completions), expected)


def test_stop_tokens_max_new_tokens_and_max_seq_len_finish_requests(
    model: PreTrainedModel,
) -> None:
    request = _requests(0.0, max_new_tokens=20, ignore_eos=True)[1]
    free = _engine(model).generate([request])[0]
    assert (len(free.output_ids), free.finish_reason) == (20, "length")
    stop = free.output_ids[5]
    first = free.output_ids.index(stop)
    sampling = msgspec.structs.replace(request.sampling, stop_token_ids=(stop,))
    stopped = _engine(model).generate([msgspec.structs.replace(request, sampling=sampling)])[0]
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    short = _engine(model, max_seq_len=len(request.prompt_ids) + 3).generate([request])[0]
    assert (short.output_ids, short.finish_reason) == (free.output_ids[:3], "length")


def test_streaming_deltas_add_up_to_the_completion(model: PreTrainedModel) -> None:
    engine = _engine(model)
    for request in _requests(1.0)[:3]:
        engine.add_request(msgspec.structs.replace(request, stream=request.request_id != "r2"))
    streamed: dict[str, list[int]] = {}
    completions = {}
    while engine.num_unfinished:
        for out in engine.step():
            if isinstance(out, TokenDelta):
                streamed.setdefault(out.request_id, []).extend(out.token_ids)
            else:
                completions[out.request_id] = out
    assert set(streamed) == {"r0", "r1"}
    for rid, tokens in streamed.items():
        assert tuple(tokens) == completions[rid].output_ids


def test_stats_report_kv_usage_running_and_queued(model: PreTrainedModel) -> None:
    engine = _engine(model, max_running_requests=2, kv_capacity_tokens=1000)
    requests = _requests(1.0)
    for request in requests:
        engine.add_request(request)
    assert engine.stats().num_queued == len(requests)
    engine.step()  # prefills the first two
    stats = engine.stats()
    held = sum(len(r.prompt_ids) + 1 for r in requests[:2])
    assert (stats.num_running, stats.num_queued) == (2, len(requests) - 2)
    assert stats.kv_usage == pytest.approx(held / 1000)
    engine.step()
    assert engine.stats().kv_usage == pytest.approx((held + 2) / 1000)
    assert engine.stats().gen_tokens_per_s > 0


def test_throughput_is_per_second_of_wall_time(model: PreTrainedModel) -> None:
    """The control plane integrates the rate over the time between reports: a worker
    that steps for 0.1 s and then waits 0.3 s generates at a quarter of its stepping
    rate, and that is what the engine reports (not the stepping rate)."""
    clock = [0.0]

    def now() -> float:
        clock[0] += 0.05  # each step reads the clock twice: 0.05 s in, 0.05 s out
        return clock[0]

    engine = _engine(model, max_running_requests=2, now_s=now)
    for request in _requests(1.0, max_new_tokens=8)[:2]:
        engine.add_request(request)
    start = clock[0]
    engine.step()  # the prefill: one token each
    engine.step()  # a decode: one more each
    clock[0] += 0.3  # the worker does something else
    engine.step()
    stats = engine.stats()  # reads the clock once more: 0.05 s
    elapsed = clock[0] - start
    assert stats.gen_tokens_per_s == pytest.approx(6 / (elapsed - 0.05), rel=1e-9)
    assert stats.gen_tokens_per_s < 6 / 0.3  # the stepping rate: 6 tokens in 0.3 s of steps


def test_waiting_requests_follow_the_request_order(model: PreTrainedModel) -> None:
    engine = _engine(model, max_running_requests=1, order=ToolCallPriorityOrder())
    for i, request in enumerate(_requests(1.0, max_new_tokens=2)[:3]):
        engine.add_request(msgspec.structs.replace(request, tool_calls=i))
    finished = [c.request_id for c in engine.generate([])]
    assert finished == ["r2", "r1", "r0"]


def test_the_data_planes_request_queue_can_be_the_waiting_queue(model: PreTrainedModel) -> None:
    queue = RequestQueue[Sequence](ToolCallPriorityOrder(), max_size=8, clock=ManualClock())
    engine = _engine(model, max_running_requests=1, queue=queue)
    for i, request in enumerate(_requests(1.0, max_new_tokens=2)[:3]):
        engine.add_request(msgspec.structs.replace(request, tool_calls=i))
    assert len(queue) == 3
    engine.abort(["r1"])
    assert [c.request_id for c in engine.generate([])] == ["r2", "r0"]


def test_bad_requests_are_refused_with_the_fix(model: PreTrainedModel) -> None:
    engine = _engine(model, max_seq_len=32)
    request = _requests()[0]
    engine.add_request(request)
    with pytest.raises(BadRequestError, match="already in this engine"):
        engine.add_request(request)
    with pytest.raises(BadRequestError, match="empty prompt"):
        engine.add_request(msgspec.structs.replace(request, request_id="e", prompt_ids=()))
    with pytest.raises(BadRequestError, match="shorten the prompt"):
        engine.add_request(msgspec.structs.replace(request, request_id="l", prompt_ids=(5,) * 32))
    with pytest.raises(EngineError, match="raise the capacity"):
        _engine(model, kv_capacity_tokens=16, max_seq_len=32)


def test_loaded_weights_carry_their_version_and_restart_running_requests() -> None:
    model = build_model(ModelConfig(), seed=0)
    new_weights = build_model(ModelConfig(), seed=1).state_dict()
    engine = _engine(model)
    requests = _requests(1.0)
    for request in requests[:2]:
        engine.add_request(request)
    for _ in range(3):
        engine.step()
    engine.load_weights(new_weights, version=1)
    assert engine.weight_version == 1 and engine.stats().num_running == 0
    for request in requests[2:]:
        engine.add_request(request)
    completions = _by_id(engine.generate([]))
    assert {c.weight_version for c in completions.values()} == {0, 1}
    assert completions["r0"].weight_version == 0  # straddled the update: the oldest version
    fresh = [c for c in completions.values() if c.weight_version == 1]
    assert len(fresh) == len(requests) - 2
    _assert_teacher_forced(model, fresh)
    with pytest.raises(WeightSyncError, match="not a parameter"):
        engine.load_weights({"nope": torch.zeros(1)}, version=2)
    assert engine.weight_version == 1


def test_released_memory_comes_back_without_changing_outputs() -> None:
    model = build_model(ModelConfig(), seed=0)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = _by_id(_engine(model).generate(_requests(0.0)))
    engine = _engine(model)
    for request in _requests(0.0):
        engine.add_request(request)
    for _ in range(4):
        engine.step()
    engine.release_memory_occupation(["kv_cache"])
    assert engine.stats().num_running == 0 and engine.num_unfinished == len(PROMPTS)
    engine.release_memory_occupation(["weights"], host_backup=True)
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(EngineError, match="resume_memory_occupation"):
        engine.step()
    engine.resume_memory_occupation()
    _assert_same(_by_id(engine.generate([])), expected)

    engine.release_memory_occupation()  # no host copy: weights must come back by a load
    engine.resume_memory_occupation()
    with pytest.raises(EngineError, match="load or update the weights"):
        engine.generate(_requests(0.0)[:1])
    engine.load_weights(weights, version=3)
    got = _by_id(engine.generate([]))
    assert got["r0"].output_ids == expected["r0"].output_ids
    assert got["r0"].weight_version == 3


def test_from_config_builds_the_engine_of_a_run() -> None:
    engine = RolloutEngine.from_config(
        ModelConfig(max_seq_len=64), RolloutConfig(max_running_requests=4), seed=0
    )
    (completion,) = engine.generate(_requests(1.0, max_new_tokens=8)[:1])
    assert 1 <= len(completion.output_ids) <= 8


def test_the_engine_counts_its_steps_by_kind_and_their_seconds(model: PreTrainedModel) -> None:
    # A step either prefills the requests it admits or decodes every running one: the
    # counts say how many of each, and the seconds what they cost (the metrics'
    # engine_steps, which the simulator's fidelity bench compares step for step).
    clock = ManualClock()

    def now_s() -> float:
        clock.advance(0.25)  # every reading a quarter second later: a step is 0.25 s
        return clock.now()

    engine = _engine(model, max_running_requests=2, kv_capacity_tokens=256, now_s=now_s)
    kinds: list[str] = []
    for request in _requests(max_new_tokens=5)[:3]:
        engine.add_request(request)
    while engine.num_unfinished:
        before = engine.stats()
        running = before.num_running
        engine.step()
        after = engine.stats()
        kinds.append("prefill" if after.prefill_steps > before.prefill_steps else "decode")
        assert after.prefill_steps + after.decode_steps == len(kinds)
        # A decode step generates a token for each request it ran (the controller
        # reads the batch from tokens over steps); a prefill's first tokens are not
        # decode tokens.
        decoded = running if kinds[-1] == "decode" else 0
        assert after.decode_tokens - before.decode_tokens == decoded
    final = engine.stats()
    # Two slots for three requests: two prefills at least (the third waits for a slot),
    # and each request decodes its remaining tokens.
    assert final.prefill_steps == kinds.count("prefill") >= 2
    assert final.decode_steps == kinds.count("decode") >= 4
    assert final.decode_tokens >= final.decode_steps
    assert final.prefill_s == pytest.approx(0.25 * final.prefill_steps)
    assert final.decode_s == pytest.approx(0.25 * final.decode_steps)


def test_a_resumed_requests_re_prefill_is_counted_apart(model: PreTrainedModel) -> None:
    # A request that comes with partial output (aborted on another engine) re-prefills
    # its prompt and that output: the engine reports those seconds apart
    # (``resume_prefill_s``, in proportion to the tokens each request feeds), so the
    # control plane keeps a move's cost out of the workload's prefill model.
    first = _engine(model, max_running_requests=3)
    for request in _requests(0.0):
        first.add_request(request)
    for _ in range(4):
        first.step()
    partial = first.abort()
    resumed = [p for p in partial if p.output_ids]
    assert resumed and len(resumed) < len(partial)
    clock = ManualClock()

    def now_s() -> float:
        clock.advance(0.25)  # a step is 0.25 s
        return clock.now()

    second = _engine(model, now_s=now_s)
    for p in partial:
        second.add_request(p)
    second.step()  # one prefill admits them all
    stats = second.stats()
    assert stats.prefill_steps == 1 and stats.prefill_s == pytest.approx(0.25)
    fed = {p.request_id: len(p.prompt_ids) + len(p.output_ids) for p in partial}
    share = sum(fed[p.request_id] for p in resumed) / sum(fed.values())
    assert stats.resume_prefill_s == pytest.approx(0.25 * share)
    while second.num_unfinished:  # decode steps and no more prefills: nothing more
        second.step()
    assert second.stats().resume_prefill_s == pytest.approx(0.25 * share)
