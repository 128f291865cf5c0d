"""The rollout engine receives weights broadcast by a trainer in another process over a
real gloo group; the version travels with them. Also: the engine's wire types stay
free of torch, so the SGLang backend can share them."""

import subprocess
import sys
import textwrap

import pytest
import torch

from dynarl.api.config import ModelConfig
from dynarl.testing.ports import free_port
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.logprobs import sequence_logprobs
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.weight_sync import join_weight_sync_group, leave_weight_sync_group

MODEL = ModelConfig(max_seq_len=64)

TRAINER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    from dynarl.api.config import ModelConfig
    from dynarl.workers.torch.model import build_model
    from dynarl.workers.torch.weight_sync import (
        join_weight_sync_group, leave_weight_sync_group, send_weights,
    )

    group = join_weight_sync_group(
        host="127.0.0.1", port=int(sys.argv[1]), rank=0, world_size=2,
        device=torch.device("cpu"), timeout_s=60,
    )
    trained = build_model(ModelConfig(max_seq_len=64), seed=1)
    send_weights(trained, version=7, group=group, bucket_bytes=1 << 16)
    leave_weight_sync_group(group)
    sys.stdout.flush()
    os._exit(0)  # like the trainer worker: skip interpreter teardown of gloo threads
    """
)


@pytest.mark.slow
def test_update_weights_from_a_trainer_process_over_gloo() -> None:
    tokenizer = build_tokenizer()
    engine = RolloutEngine(build_model(MODEL, seed=0), eos_token_id=tokenizer.eos_token_id)
    for i in range(3):
        engine.add_request(
            GenerateRequest(
                request_id=f"r{i}",
                prompt_ids=tuple(tokenizer.encode(f"prompt {i}")),
                sampling=SamplingParams(max_new_tokens=12, seed=i),
            )
        )
    engine.step()
    engine.step()  # in flight when the weights arrive

    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port)])
    try:
        group = join_weight_sync_group(
            host="127.0.0.1",
            port=port,
            rank=1,
            world_size=2,
            device=torch.device("cpu"),
            timeout_s=60,
        )
        assert engine.update_weights(group) == 7
        leave_weight_sync_group(group)
    finally:
        assert trainer.wait(timeout=60) == 0

    assert engine.weight_version == 7
    trained = build_model(MODEL, seed=1)
    for (name, got), want in zip(
        engine.model.named_parameters(), trained.parameters(), strict=True
    ):
        assert torch.equal(got, want), name

    engine.add_request(
        GenerateRequest(request_id="after", prompt_ids=tuple(tokenizer.encode("after")))
    )
    completions = {c.request_id: c for c in engine.generate([])}
    assert {c.weight_version for c in completions.values()} == {0, 7}
    assert completions["after"].weight_version == 7
    _assert_scored_by(trained, completions["after"])


def _assert_scored_by(model: torch.nn.Module, completion: Completion) -> None:
    (forced,) = sequence_logprobs(
        model,  # type: ignore[arg-type]
        [completion.prompt_ids + completion.output_ids],
        starts=[len(completion.prompt_ids)],
    )
    assert torch.allclose(torch.tensor(completion.output_logprobs), forced, atol=1e-4, rtol=0)


def test_wire_types_and_scheduler_import_without_torch() -> None:
    code = (
        "import sys, dynarl.workers.rollout, dynarl.workers.torch.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
