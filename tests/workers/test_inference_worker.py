"""The reference inference worker: old-policy and reference log-probs in micro-batches,
interruptible between them."""

import pytest
import torch

from dynarl.api.config import InferenceConfig, ModelConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.inference import InferenceWorker, LogprobRequest, LogprobResult
from dynarl.workers.torch.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER = build_tokenizer()
MODEL = ModelConfig(max_seq_len=64)


def _rollouts(n: int = 5) -> tuple[list[LogprobRequest], dict[str, tuple[float, ...]]]:
    """Rollouts of the seed-0 policy as the inference stage receives them, and the
    log-probs the rollout engine reported for them."""
    engine = RolloutEngine(build_model(MODEL, seed=0), eos_token_id=TOKENIZER.eos_token_id)
    prompts = [TOKENIZER.encode(f"{i} + {i * 7} =") for i in range(n)]
    completions = engine.generate(
        GenerateRequest(
            request_id=f"s{i}",
            prompt_ids=tuple(p),
            sampling=SamplingParams(max_new_tokens=6 + 3 * i, seed=i),
        )
        for i, p in enumerate(prompts)
    )
    completions.sort(key=lambda c: c.request_id)
    samples = [
        LogprobRequest(
            item_id=c.request_id,
            token_ids=c.prompt_ids + c.output_ids,
            response_start=len(c.prompt_ids),
        )
        for c in completions
    ]
    return samples, {c.request_id: c.output_logprobs for c in completions}


def _samples(n: int = 5) -> list[LogprobRequest]:
    return _rollouts(n)[0]


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_old_policy_logprobs_match_what_the_rollout_reported() -> None:
    samples, rollout = _rollouts()
    worker = InferenceWorker.from_config(MODEL, InferenceConfig(micro_batch_size=2), seed=0)
    worker.submit(samples)
    results = worker.run()
    assert [r.item_id for r in results] == [s.item_id for s in samples]
    for result in results:
        assert result.ref_logprobs is None and result.weight_version == 0
        assert _close(result.logprobs, rollout[result.item_id])


def test_interrupt_between_micro_batches_hands_back_the_rest() -> None:
    samples = _samples()
    config = InferenceConfig(micro_batch_size=2)
    worker = InferenceWorker.from_config(MODEL, config, seed=0)
    worker.submit(samples)
    done = worker.step()
    assert [r.item_id for r in done] == ["s0", "s1"]
    left = worker.interrupt()
    assert left == samples[2:]
    assert worker.progress().num_done == 2 and worker.progress().num_pending == 0
    assert worker.step() == []

    elsewhere = InferenceWorker.from_config(MODEL, config, seed=0)
    elsewhere.submit(left)
    finished: dict[str, LogprobResult] = {r.item_id: r for r in done + elsewhere.run()}
    uninterrupted = InferenceWorker.from_config(MODEL, InferenceConfig(micro_batch_size=5), seed=0)
    uninterrupted.submit(samples)
    for result in uninterrupted.run():
        assert _close(finished[result.item_id].logprobs, result.logprobs)


def test_reference_stays_frozen_while_the_policy_moves() -> None:
    samples = _samples(3)
    config = InferenceConfig(micro_batch_size=4, compute_ref_logprobs=True)
    worker = InferenceWorker.from_config(MODEL, config, seed=0)
    worker.submit(samples)
    before = worker.run()
    assert all(r.ref_logprobs == r.logprobs for r in before)

    worker.load_weights(build_model(MODEL, seed=1).state_dict(), version=4)
    worker.release_memory_occupation()
    with pytest.raises(EngineError, match="released"):
        worker.step()
    worker.resume_memory_occupation()
    worker.submit(samples)
    after = worker.run()
    for old, new in zip(before, after, strict=True):
        assert new.weight_version == 4
        assert new.ref_logprobs == old.ref_logprobs  # bit for bit: same batch, same weights
        assert not _close(new.logprobs, old.logprobs)


def test_samples_without_a_response_are_refused() -> None:
    worker = InferenceWorker(build_model(MODEL, seed=0), micro_batch_size=2)
    with pytest.raises(BadRequestError, match="response_start"):
        worker.submit([LogprobRequest(item_id="x", token_ids=(4, 5), response_start=0)])
    assert worker.progress().num_pending == 0
