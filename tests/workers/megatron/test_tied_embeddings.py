"""A model with tied embeddings (Qwen2.5-0.5B's ``tie_word_embeddings=True``) split over
pipeline stages trains as on one rank: the last stage's output layer is a copy of the
first stage's embedding, their gradients are summed over the embedding group, and the
copies stay equal. PP=2 (torch's AdamW, gradient clipping on), PP=4 (middle stages hold
neither copy), PP=2 x DP=2 with Megatron's distributed optimizer, and a checkpoint of
the PP=4 run resumed at TP=2 x PP=2 all give PP=1's losses and weights.

Four processes are started once for the module; each layout is built on them in turn,
from the same saved checkpoint, and runs the same minibatches."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gloo_processes import gather_from_workers

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

WORLD = 4
STEPS = 4
# name: (members, tp, pp, distributed optimizer, first step)
LAYOUTS = {
    "pp1": ((0,), 1, 1, False, 0),
    "pp2": ((2, 3), 1, 2, False, 0),
    "pp4": ((0, 1, 2, 3), 1, 4, False, 0),
    "tp2pp2_resumed": ((0, 1, 2, 3), 2, 2, False, 2),  # from the checkpoint of pp4
    "pp2dp2_distributed": ((0, 1, 2, 3), 1, 2, True, 0),
}
# The loss does not depend on a key bias (softmax is shift-invariant): its gradient is
# rounding noise that Adam turns into real steps, held to the global bound only.
CLIP = 0.3
NOISE_ONLY = ".self_attn.k_proj.bias"


def _save_tied_model(path: Path) -> None:
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.tokenizer import build_tokenizer
    from dynarl.workers.torch.model import model_config, save_pretrained

    tokenizer = build_tokenizer()
    config = model_config(ModelConfig(max_seq_len=64, num_layers=4), tokenizer)
    config.tie_word_embeddings = True
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random biases and norms (transformers initialises them flat)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_pretrained(model, tokenizer, path)


def _config() -> Any:
    from dynarl.workers.torch.trainer_config import TrainerConfig

    return TrainerConfig(
        micro_batch_size=4, lr=1e-2, grad_clip=CLIP, timeout_s=90.0, reshard_timeout_s=30.0
    )


def _worker(worker: int, port: int, path: str, results: Any) -> None:
    import torch.distributed as dist

    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.testing.minibatches import random_minibatch
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron import state
    from dynarl.workers.megatron.layout import Layout, build_groups
    from dynarl.workers.megatron.rank import MegatronRank
    from dynarl.workers.megatron.spec import ModelSpec

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=worker, world_size=WORLD
    )
    model = ModelConfig(path=path, max_seq_len=64, num_layers=4)
    loss = GrpoLoss.from_config(AlgorithmConfig())
    config = _config()
    hf_state = ModelSpec(model=model).hf_state()
    checkpoint = f"{path}/pp4-after-2-steps.pt"
    for name, (members, tp, pp, distributed, first) in LAYOUTS.items():
        spec = ModelSpec(model=model, tp=tp, pp=pp, distributed_optimizer=distributed)
        groups = build_groups(Layout(members, tp, pp), worker=worker, timeout_s=60)
        if groups is not None:
            rank = MegatronRank.create(
                spec, loss_fn=loss, config=config, groups=groups, hf_state=hf_state
            )
            if first:
                state.load_checkpoint(rank, checkpoint)
            out: dict[str, Any] = {"losses": [], "grad_norms": []}
            for step in range(first, STEPS):
                batch = {k: torch.as_tensor(v) for k, v in random_minibatch(step).items()}
                metrics = rank.train_step(batch)
                out["losses"].append(metrics.loss)
                out["grad_norms"].append(metrics.grad_norm)
                if name == "pp4" and step == first + 1:
                    saved = state.gather_full_state(rank)
                    if saved is not None:
                        state.write_checkpoint(saved, checkpoint)
            out["copy_difference"] = _copy_difference(rank, groups)
            full = state.gather_full_state(rank)
            if full is not None:
                out["model"] = full["model"]
                # plain arrays: a tensor in a queue is shared memory that goes when
                # this process ends, which it may before the test reads it
                results.put((name, _arrays(out)))
            groups.destroy()
        dist.barrier()  # the next layout may read this one's checkpoint
    dist.destroy_process_group()


def _copy_difference(rank: Any, groups: Any) -> float:
    """The largest difference between the embedding and its copy on the last stage,
    over every pair of the replica (-1: the rank holds no copy)."""
    import torch.distributed as dist

    found = torch.tensor([-1.0], dtype=torch.float64)
    if groups.embedding is not None:
        weight = rank.model.shared_embedding_or_output_weight().detach()
        both = [torch.empty_like(weight) for _ in range(2)]
        dist.all_gather(both, weight, group=groups.embedding)
        found[0] = float((both[0] - both[1]).abs().max())
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=groups.replica)
    return float(found[0])


def _arrays(out: Any) -> Any:
    if isinstance(out, dict):
        return {k: _arrays(v) for k, v in out.items()}
    return out.numpy() if isinstance(out, torch.Tensor) else out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tied")
    _save_tied_model(path)
    return path


@pytest.fixture(scope="module")
def outcomes(checkpoint: Path) -> dict[str, dict[str, Any]]:
    return gather_from_workers(_worker, world=WORLD, expected=len(LAYOUTS), args=(str(checkpoint),))


@pytest.mark.parametrize("layout", ["pp2", "pp4", "tp2pp2_resumed", "pp2dp2_distributed"])
def test_tied_embeddings_split_over_stages_train_as_one_rank(
    outcomes: dict[str, Any], layout: str
) -> None:
    one, split = outcomes["pp1"], outcomes[layout]
    first = LAYOUTS[layout][4]
    np.testing.assert_allclose(split["losses"], one["losses"][first:], rtol=1e-5)
    np.testing.assert_allclose(split["grad_norms"], one["grad_norms"][first:], rtol=1e-4)
    assert max(one["grad_norms"]) > CLIP  # clipping took part
    assert split["copy_difference"] == 0.0  # the output layer is still the embedding
    assert one["copy_difference"] == -1.0  # one stage: no copy
    assert sorted(split["model"]) == sorted(one["model"])
    assert "lm_head.weight" not in one["model"]
    diff = norm = 0.0
    for name, expected in one["model"].items():
        got = split["model"][name]
        diff += float(np.square(got.astype(np.float64) - expected).sum())
        norm += float(np.square(expected.astype(np.float64)).sum())
        if not name.endswith(NOISE_ONLY):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5, err_msg=name)
    assert (diff / norm) ** 0.5 < 1e-4


def test_the_embedding_trains(outcomes: dict[str, Any], tmp_path: Path) -> None:
    """The comparison above proves something: the tied embedding moved from the
    checkpoint's."""
    _save_tied_model(tmp_path)
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    before = start.model.embed_tokens.weight.detach().numpy()
    after = outcomes["pp1"]["model"]["model.embed_tokens.weight"]
    assert np.abs(after - before).max() > 1e-3


@pytest.mark.asyncio
async def test_reshard_to_pp2_and_dp_resizes_of_a_tied_model_equal_one_rank(
    outcomes: dict[str, Any], checkpoint: Path, tmp_path: Path
) -> None:
    """Through the trainer pool's workers: PP=1 -> (reshard) PP=2 -> (resize) PP=2 x
    DP=2 -> (resize, the first replica leaves) PP=2 on the joiners, one step each,
    equals the fixed PP=1 run: each layout's embedding group is built, the reshard cuts
    the copy from the embedding, and the data-parallel resize moves it."""
    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.testing.minibatches import random_minibatch
    from dynarl.testing.workers import LocalWorkers
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron.main import megatron_trainer_main
    from dynarl.workers.megatron.pool import MegatronPool
    from dynarl.workers.megatron.spec import ModelSpec

    spec = ModelSpec(model=ModelConfig(path=str(checkpoint), max_seq_len=64, num_layers=4))
    loss = GrpoLoss.from_config(AlgorithmConfig())
    names = [f"tied-{i}" for i in range(WORLD)]
    async with LocalWorkers(megatron_trainer_main, names) as workers:
        pool = MegatronPool(_config(), workers=workers.channels, model_factory=spec, loss_fn=loss)
        await pool.start()
        try:
            await pool.start_training([0])
            losses = [(await pool.train_step(random_minibatch(0))).loss]
            await pool.reshard([0, 1], tp=1, pp=2)
            losses.append((await pool.train_step(random_minibatch(1))).loss)
            grown = await pool.resize([0, 1, 2, 3])
            assert grown.bytes_moved > 0
            losses.append((await pool.train_step(random_minibatch(2))).loss)
            await pool.resize([2, 3])
            losses.append((await pool.train_step(random_minibatch(3))).loss)
            await pool.save_checkpoint(tmp_path / "end.pt")
        finally:
            await pool.close()
    one = outcomes["pp1"]
    np.testing.assert_allclose(losses, one["losses"], rtol=1e-5)
    saved = torch.load(tmp_path / "end.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(one["model"])
    for name, expected in one["model"].items():
        if not name.endswith(NOISE_ONLY):
            np.testing.assert_allclose(
                saved[name].numpy(), expected, rtol=1e-4, atol=2e-5, err_msg=name
            )
