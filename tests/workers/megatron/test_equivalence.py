"""Splitting the model does not change the maths: tensor parallel (TP=2), pipeline
parallel (PP=2) and both together give TP=PP=1's logits, gradients and training
losses (fp32 tolerance), on real gloo groups between four processes.

The four processes are started once for the module; each layout is built on them in
turn (every layout's groups are created by all four, members or not), from the same HF
weights, and runs the same micro-batches."""

from typing import Any

import numpy as np
import pytest
from gloo_processes import gather_from_workers

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow

WORLD = 4
LAYOUTS = {
    "tp1": ((0,), 1, 1),
    "tp2": ((0, 1), 2, 1),
    "pp2": ((2, 3), 1, 2),
    "tp2pp2": ((0, 1, 2, 3), 2, 2),
}


def _minibatch(step: int, n: int = 6, length: int = 20) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    mask = np.zeros((n, length), dtype=np.float32)
    mask[:, 6:] = 1.0
    attention = np.ones((n, length), dtype=np.int64)
    attention[1, 15:] = 0  # a right-padded row
    mask[1, 15:] = 0.0
    return {
        "input_ids": torch.tensor(rng.integers(4, 90, size=(n, length))),
        "attention_mask": torch.tensor(attention),
        "loss_mask": torch.tensor(mask),
        "old_logprobs": torch.full((n, length), -4.0),
        "advantages": torch.tensor(rng.standard_normal(n).astype(np.float32)),
    }


def _worker(worker: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron import state
    from dynarl.workers.megatron.layout import Layout, build_groups
    from dynarl.workers.megatron.model import causal_logits
    from dynarl.workers.megatron.rank import MegatronRank
    from dynarl.workers.megatron.spec import ModelSpec
    from dynarl.workers.torch.trainer_config import TrainerConfig

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=worker, world_size=WORLD
    )
    model = ModelConfig(max_seq_len=64, num_layers=2, num_heads=4, num_kv_heads=2)
    loss = GrpoLoss.from_config(AlgorithmConfig())
    config = TrainerConfig(micro_batch_size=4, lr=1e-2)
    hf_state = ModelSpec(model=model).hf_state()
    for name, (members, tp, pp) in LAYOUTS.items():
        spec = ModelSpec(model=model, tp=tp, pp=pp)
        groups = build_groups(Layout(members, tp, pp), worker=worker, timeout_s=60)
        if groups is None:
            continue
        rank = MegatronRank.create(
            spec, loss_fn=loss, config=config, groups=groups, hf_state=hf_state
        )
        batch = _minibatch(0)
        out: dict[str, Any] = {}
        if pp == 1:
            with torch.no_grad():
                out["logits"] = causal_logits(
                    rank.model,
                    batch["input_ids"],
                    batch["attention_mask"],
                    vocab_size=rank.arch.vocab_size,
                )
        rank.accumulate(batch)
        grads = state.gather_hf(rank, {n: p.grad for n, p in rank.model.named_parameters()})
        out["grads"] = grads
        out["losses"] = [rank.train_step(_minibatch(s)).loss for s in range(1, 4)]
        if worker == groups.leader:
            # plain arrays: a tensor in a queue is shared memory that goes when this
            # process ends, which it may before the test reads it
            results.put((name, _arrays(out)))
        groups.destroy()
    dist.barrier()
    dist.destroy_process_group()


def _arrays(out: Any) -> Any:
    if isinstance(out, dict):
        return {k: _arrays(v) for k, v in out.items()}
    return out.numpy() if isinstance(out, torch.Tensor) else out


def _tensors(out: Any) -> Any:
    if isinstance(out, dict):
        return {k: _tensors(v) for k, v in out.items()}
    return torch.from_numpy(out) if isinstance(out, np.ndarray) else out


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, Any]]:
    got = gather_from_workers(_worker, world=WORLD, expected=len(LAYOUTS), timeout_s=100)
    return {name: _tensors(out) for name, out in got.items()}


def test_tensor_parallel_logits_and_gradients_equal_one_rank(outcomes: dict[str, Any]) -> None:
    one, two = outcomes["tp1"], outcomes["tp2"]
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    assert sorted(two["grads"]) == sorted(one["grads"])
    for name, grad in one["grads"].items():
        assert grad.abs().sum() > 0, f"{name} got no gradient: the comparison proves nothing"
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2pp2"])
def test_split_training_equals_one_rank(outcomes: dict[str, Any], layout: str) -> None:
    one = outcomes["tp1"]
    for name, grad in one["grads"].items():
        torch.testing.assert_close(outcomes[layout]["grads"][name], grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(outcomes[layout]["losses"], one["losses"], rtol=1e-5)
    assert len(set(np.round(one["losses"], 6))) > 1
