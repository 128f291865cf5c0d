"""The Megatron rank trains like the torch backend's rank: from the same seed, the
same GRPO steps give the same losses, gradient norms and weights (in one process, a
world of one)."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynarl.api.config import AlgorithmConfig  # noqa: E402
from dynarl.rl.grpo import GrpoLoss  # noqa: E402
from dynarl.workers.config import ModelConfig  # noqa: E402
from dynarl.workers.megatron import state  # noqa: E402
from dynarl.workers.megatron.layout import Layout, build_groups  # noqa: E402
from dynarl.workers.megatron.model import single_process_groups  # noqa: E402
from dynarl.workers.megatron.rank import MegatronRank  # noqa: E402
from dynarl.workers.megatron.spec import ModelSpec  # noqa: E402
from dynarl.workers.torch.model import build_model  # noqa: E402
from dynarl.workers.torch.trainer import ElasticTrainer  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = ModelConfig(max_seq_len=64, num_layers=2)
CONFIG = TrainerConfig(micro_batch_size=3, lr=1e-3)
# The loss does not depend on a key bias (softmax is shift-invariant), so its gradient is
# rounding noise that Adam turns into real steps: held to the global bound only.
NOISE_ONLY = ".self_attn.k_proj.bias"
PAD = 0  # the built-in tokenizer's pad id


def minibatch(step: int, n: int = 7, length: int = 18) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(step)
    lengths = rng.integers(10, length + 1, size=n)
    attention = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    mask = attention.astype(np.float32)
    mask[:, :6] = 0.0
    ids = rng.integers(4, 90, size=(n, length))
    # The pad token (0) as a real token too (a policy samples it): transformers' input
    # embedding passes no gradient to its row (padding_idx), and neither may Megatron's.
    ids[:, 7] = PAD
    return {
        "input_ids": torch.tensor(ids * attention),
        "attention_mask": torch.tensor(attention),
        "loss_mask": torch.tensor(mask),
        "old_logprobs": torch.full((n, length), -4.0),
        "advantages": torch.tensor(rng.standard_normal(n).astype(np.float32)),
    }


def test_megatron_steps_equal_the_torch_trainers_steps() -> None:
    loss = GrpoLoss.from_config(AlgorithmConfig())
    reference = ElasticTrainer.build(
        functools.partial(build_model, MODEL, seed=5),
        loss_fn=loss,
        config=CONFIG,
        device=torch.device("cpu"),
        group=None,
    )
    single_process_groups()  # a world of one in this process
    groups = build_groups(Layout((0,), 1, 1), worker=0, timeout_s=30)
    assert groups is not None
    spec = ModelSpec(model=MODEL, seed=5)
    assert spec.architecture().padding_idx == PAD
    rank = MegatronRank.create(
        spec, loss_fn=loss, config=CONFIG, groups=groups, hf_state=spec.hf_state()
    )
    for step in range(3):
        expected = reference.train_step(minibatch(step))
        got = rank.train_step(minibatch(step))
        assert got.loss == pytest.approx(expected.loss, rel=1e-5)
        assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4)
        assert got.normaliser == expected.normaliser
    weights = state.gather_hf_weights(rank)
    assert weights is not None
    theirs = {n: p.detach() for n, p in reference.model.named_parameters()}
    diff = norm = 0.0
    for name, tensor in weights.items():
        diff += float((tensor - theirs[name]).double().square().sum())
        norm += float(theirs[name].double().square().sum())
        if not name.endswith(NOISE_ONLY):
            torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=2e-5)
    assert (diff / norm) ** 0.5 < 1e-4
    groups.destroy()
