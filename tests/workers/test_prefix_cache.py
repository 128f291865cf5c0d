"""The reference engine's per-session prefix cache on a real tiny model: a session's next
turn reuses its last turn's KV and generates exactly what a full prefill would; new
weights invalidate it; running requests always take precedence over it."""

import msgspec
import pytest
import torch
from transformers import PreTrainedModel

from dynarl.api.config import ModelConfig
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER = build_tokenizer()
PROMPTS = ["What is 7*6?", "The quick brown fox jumps", "x=1;y=2"]
OBSERVATION = tuple(TOKENIZER.encode("<tool_response>42</tool_response>"))


def _engine(model: PreTrainedModel, **kwargs: object) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=TOKENIZER.eos_token_id, **kwargs)  # type: ignore[arg-type]


def _turn1(num_sessions: int = 3, max_new_tokens: int = 12) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"s{i}",
            prompt_ids=tuple(TOKENIZER.encode(prompt)),
            sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=100 + i, ignore_eos=True),
            multi_turn=True,
        )
        for i, prompt in enumerate(PROMPTS[:num_sessions])
    ]


def _turn2(done: list[Completion]) -> list[GenerateRequest]:
    """Each session's next turn: its whole context so far plus an observation."""
    return [
        GenerateRequest(
            request_id=c.request_id,
            prompt_ids=c.prompt_ids + c.output_ids + OBSERVATION,
            sampling=SamplingParams(max_new_tokens=10, seed=7 + i, ignore_eos=True),
            multi_turn=True,
            tool_calls=1,
        )
        for i, c in enumerate(sorted(done, key=lambda c: c.request_id))
    ]


def _by_id(completions: list[Completion]) -> dict[str, Completion]:
    return {c.request_id: c for c in completions}


def _assert_same(got: dict[str, Completion], want: dict[str, Completion]) -> None:
    assert got.keys() == want.keys()
    for rid, expected in want.items():
        assert got[rid].output_ids == expected.output_ids, rid
        assert torch.allclose(
            torch.tensor(got[rid].output_logprobs),
            torch.tensor(expected.output_logprobs),
            atol=1e-5,
            rtol=0,
        ), rid


def test_a_next_turn_on_its_cached_prefix_generates_what_a_full_prefill_does(
    model: PreTrainedModel,
) -> None:
    engine = _engine(model)
    first = engine.generate(_turn1())
    assert len(engine.prefix_cache) == 3
    assert all(c.cached_tokens == 0 for c in first)
    turn2 = _turn2(first)
    # A fresh single-turn request rides in the same prefill batch as the cached rows.
    plain = GenerateRequest(
        request_id="plain",
        prompt_ids=tuple(TOKENIZER.encode("hello there")),
        sampling=SamplingParams(max_new_tokens=10, seed=3),
    )
    held = {
        r.request_id: engine.prefix_cache.match_tokens(r.request_id, r.prompt_ids) for r in turn2
    }
    got = _by_id(engine.generate([*turn2, plain]))
    want = _by_id(_engine(model).generate([*turn2, plain]))

    _assert_same(got, want)
    for c in first:  # every token of turn 1 but its last sampled one was reused
        assert held[c.request_id] == len(c.prompt_ids) + len(c.output_ids) - 1
        assert got[c.request_id].cached_tokens == held[c.request_id]
        assert want[c.request_id].cached_tokens == 0
    assert got["plain"].cached_tokens == 0
    stats = engine.stats()
    assert stats.prefix_hit_tokens == sum(held.values())
    assert engine.prefix_cache.num_hits == 3


def test_a_context_that_does_not_extend_the_cached_prefix_prefills_from_scratch(
    model: PreTrainedModel,
) -> None:
    engine = _engine(model)
    first = engine.generate(_turn1(num_sessions=1))
    edited = msgspec.structs.replace(
        _turn2(first)[0], prompt_ids=(first[0].prompt_ids[0] + 1, *_turn2(first)[0].prompt_ids[1:])
    )
    got = engine.generate([edited])
    assert got[0].cached_tokens == 0 and engine.prefix_cache.num_misses == 2
    _assert_same(_by_id(got), _by_id(_engine(model).generate([edited])))


def test_a_weight_update_drops_every_cached_prefix() -> None:
    model = build_model(ModelConfig(), seed=0)
    engine = _engine(model)
    first = engine.generate(_turn1())
    assert engine.stats().cached_prefix_tokens > 0
    new_weights = {name: p.detach() * 1.5 for name, p in model.named_parameters()}
    engine.load_weights(new_weights, version=1)
    assert len(engine.prefix_cache) == 0 and engine.stats().cached_prefix_tokens == 0
    got = _by_id(engine.generate(_turn2(first)))
    assert all(c.cached_tokens == 0 and c.weight_version == 1 for c in got.values())
    _assert_same(got, _by_id(_engine(model).generate(_turn2(first))))


def test_cached_prefixes_are_evicted_least_recent_first_and_never_before_running_requests(
    model: PreTrainedModel,
) -> None:
    engine = _engine(model, kv_capacity_tokens=128, max_seq_len=128)
    first = engine.generate(_turn1(num_sessions=2))
    assert "s0" in engine.prefix_cache and "s1" in engine.prefix_cache
    engine.end_session("s0")
    assert "s0" not in engine.prefix_cache and "s1" in engine.prefix_cache
    # Plain requests that need the whole budget push the prefix out while running.
    plain = [
        GenerateRequest(
            request_id=f"p{i}",
            prompt_ids=tuple(TOKENIZER.encode("The quick brown fox jumps")),
            sampling=SamplingParams(max_new_tokens=90, seed=i, ignore_eos=True),
        )
        for i in range(2)
    ]
    for request in plain:
        engine.add_request(request)
    done: list[Completion] = []
    while engine.num_unfinished:
        done += [o for o in engine.step() if isinstance(o, Completion)]
        stats = engine.stats()
        assert stats.kv_tokens + stats.cached_prefix_tokens <= 128
    assert engine.prefix_cache.num_evicted == 1 and "s1" not in engine.prefix_cache
    _assert_same(
        _by_id(done),
        _by_id(_engine(model, kv_capacity_tokens=128, max_seq_len=128).generate(plain)),
    )
    # The evicted session's next turn still runs, from scratch.
    resumed = engine.generate(_turn2(first)[1:])
    assert resumed[0].cached_tokens == 0


def test_lru_keeps_the_most_recently_finished_session(model: PreTrainedModel) -> None:
    engine = _engine(model, kv_capacity_tokens=64, max_seq_len=64)
    engine.generate(_turn1(num_sessions=1))
    engine.generate(_turn1(num_sessions=2)[1:])
    # One more long plain request: only room for one of the two kept prefixes.
    tokens_s1 = len(TOKENIZER.encode(PROMPTS[1])) + 11
    engine.add_request(
        GenerateRequest(
            request_id="big",
            prompt_ids=tuple(range(5, 5 + 64 - tokens_s1 - 2)),
            sampling=SamplingParams(max_new_tokens=1),
        )
    )
    engine.step()
    assert "s0" not in engine.prefix_cache and "s1" in engine.prefix_cache
