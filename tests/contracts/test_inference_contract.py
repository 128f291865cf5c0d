"""The inference role's contract (:class:`~dynarl.workers.inference.InferenceEngine`),
for every inference backend: scores come back in order, one per response token, with
reference log-probs exactly when configured; a malformed sample is a typed error and
nothing is scored; memory is released and resumed without changing a score; weight
versions travel with the weights."""

import anyio
import numpy as np
import pytest

from dynarl.testing.ports import free_port
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.weights import WeightSyncGroup

from .conftest import MODEL, InferenceFactory

TOKENIZER = build_tokenizer()


def samples(n: int = 6) -> list[LogprobRequest]:
    out = []
    for i in range(n):
        prompt = TOKENIZER.encode(f"{i} + {i * 7} =")
        response = TOKENIZER.encode(f" {i * 8}" + "!" * i)
        out.append(
            LogprobRequest(
                item_id=f"s{i}",
                token_ids=tuple(prompt + response),
                response_start=len(prompt),
            )
        )
    return out


async def test_scores_come_in_order_one_per_response_token(
    inference_factory: InferenceFactory,
) -> None:
    engine = inference_factory()
    batch = samples()
    results = await engine.score(batch)
    assert [r.item_id for r in results] == [s.item_id for s in batch]
    for sample, result in zip(batch, results, strict=True):
        assert len(result.logprobs) == len(sample.token_ids) - sample.response_start
        assert all(lp <= 0.0 for lp in result.logprobs)
        assert result.ref_logprobs is None
        assert result.weight_version == engine.weight_version == 0
    # Scoring does not depend on what else is in the batch.
    alone = await engine.score(batch[2:3])
    np.testing.assert_allclose(alone[0].logprobs, results[2].logprobs, atol=1e-5)
    assert engine.progress().num_done == len(batch) + 1


async def test_reference_logprobs_come_when_configured(
    inference_factory: InferenceFactory,
) -> None:
    engine = inference_factory(compute_ref_logprobs=True)
    results = await engine.score(samples(3))
    for result in results:
        assert result.ref_logprobs is not None
        # Before any update the policy is the reference.
        np.testing.assert_allclose(result.ref_logprobs, result.logprobs, atol=1e-5)


async def test_a_malformed_sample_is_refused_and_nothing_is_scored(
    inference_factory: InferenceFactory,
) -> None:
    engine = inference_factory()
    good = samples(2)
    bad = LogprobRequest(item_id="bad", token_ids=(4, 5, 6), response_start=9)
    with pytest.raises(BadRequestError, match="response_start"):
        await engine.score([good[0], bad, good[1]])
    assert engine.progress().num_done == 0
    assert len(await engine.score(good)) == 2


async def test_released_memory_resumes_with_the_same_scores(
    inference_factory: InferenceFactory,
) -> None:
    engine = inference_factory(compute_ref_logprobs=True)
    before = await engine.score(samples(3))
    await engine.release_memory()
    await engine.resume_memory()
    after = await engine.score(samples(3))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
        np.testing.assert_allclose(a.ref_logprobs or (), b.ref_logprobs or (), atol=1e-6)


async def test_weights_arrive_with_their_version_and_leave_the_reference(
    inference_factory: InferenceFactory,
) -> None:
    import torch

    from dynarl.workers.torch import weight_sync
    from dynarl.workers.torch.model import build_model

    trained = build_model(MODEL, seed=1)
    manifest = weight_sync.manifest_of(trained, version=3, bucket_bytes=1 << 20)
    port = free_port()

    def send() -> None:
        sender = weight_sync.join_weight_sync_group(
            host="127.0.0.1",
            port=port,
            rank=0,
            world_size=2,
            device=torch.device("cpu"),
            timeout_s=30.0,
        )
        weight_sync.send_by_manifest(trained, manifest, group=sender)
        weight_sync.leave_weight_sync_group(sender)

    engine = inference_factory(compute_ref_logprobs=True)
    group = WeightSyncGroup(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=30.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, send)
        await engine.join_weight_sync(group)
        assert await engine.receive_weights(manifest) == 3
        await engine.leave_weight_sync()
    results = await engine.score(samples(3))
    assert {r.weight_version for r in results} == {3}
    for result in results:
        assert result.ref_logprobs is not None
        assert not np.allclose(result.logprobs, result.ref_logprobs, atol=1e-4)
