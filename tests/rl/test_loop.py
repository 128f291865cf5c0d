"""The in-process reference loop's plumbing: weights reach the engine, the engine's
log-probs are the old policy's, and every loss option runs end to end."""

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from dynarl.api.config import (
    ActorConfig,
    AlgorithmConfig,
    DynaRLConfig,
    InferenceConfig,
    RolloutConfig,
    RunConfig,
)
from dynarl.core.errors import ConfigError
from dynarl.envs.prompts import Prompt, PromptSampler
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.torch.logprobs import sequence_logprobs
from dynarl.workers.torch.reference_loop import InprocessLoop, run_inprocess

SMALL = DynaRLConfig(
    algorithm=AlgorithmConfig(num_prompts=4, group_size=4, n_minibatches=2),
    rollout=RolloutConfig(max_new_tokens=24),
    actor=ActorConfig(lr=3e-3, micro_batch_size=8),
    run=RunConfig(seed=3),
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_engine_weights_follow_the_trainer_and_old_logprobs_match() -> None:
    """After an iteration the engine generates with the trainer's weights, and its
    log-probs are the old-policy log-probs the loss needs (ratio 1 before a step)."""
    loop = InprocessLoop(SMALL)
    before = {n: p.detach().clone() for n, p in loop.trainer.model.named_parameters()}
    metrics = loop.run_iteration()
    assert loop.engine.weight_version == 1 and loop.iteration == 1
    assert 0.0 <= metrics.mean_reward <= 1.0 and metrics.max_response_tokens <= 24
    trainer_params = dict(loop.trainer.model.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer_params.items())
    for name, param in loop.engine.model.named_parameters():
        assert torch.equal(param, trainer_params[name]), name
    (prompt,) = loop.sampler.take(1)
    request = GenerateRequest(
        request_id="check", prompt_ids=loop.encode(prompt), sampling=SamplingParams(seed=5)
    )
    (completion,) = loop.engine.generate([request])
    (teacher_forced,) = sequence_logprobs(
        loop.trainer.model,  # type: ignore[arg-type]
        [completion.prompt_ids + completion.output_ids],
        starts=[len(completion.prompt_ids)],
    )
    torch.testing.assert_close(
        teacher_forced, torch.tensor(completion.output_logprobs), atol=1e-4, rtol=0
    )


def test_kl_seq_mean_and_a_custom_source_and_verifier_run() -> None:
    config = DynaRLConfig(
        algorithm=AlgorithmConfig(
            num_prompts=2, group_size=4, n_minibatches=4, kl_coef=0.1, loss_agg="seq-mean"
        ),
        rollout=RolloutConfig(max_new_tokens=16),
        inference=InferenceConfig(compute_ref_logprobs=True),
        actor=ActorConfig(micro_batch_size=2),
    )
    prompts = [Prompt(prompt_id=str(i), text=f"say {i}") for i in range(3)]
    seen: list[str] = []

    def verifier(prompt: Prompt, response: str) -> float:
        seen.append(prompt.prompt_id)
        return float(len(response) % 2)

    history = run_inprocess(
        config,
        num_iterations=2,
        sampler=PromptSampler(prompts, shuffle=False),
        verifier=verifier,
    )
    assert len(history) == 2
    assert seen == ["0"] * 4 + ["1"] * 4 + ["2"] * 4 + ["0"] * 4
    assert all(np.isfinite(m.loss) and np.isfinite(m.grad_norm) for m in history)


def test_runs_are_reproducible() -> None:
    first = [m.mean_reward for m in run_inprocess(SMALL, num_iterations=2)]
    again = [m.mean_reward for m in run_inprocess(SMALL, num_iterations=2)]
    assert first == again


def test_the_on_policy_reference_loop_refuses_partial_rollouts() -> None:
    cfg = msgspec.structs.replace(
        SMALL, algorithm=AlgorithmConfig(num_prompts=4, group_size=4, over_sample_prompts=2)
    )
    with pytest.raises(ConfigError, match="over_sample_prompts=0"):
        InprocessLoop(cfg)
