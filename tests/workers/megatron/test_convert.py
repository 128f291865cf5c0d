"""Megatron models from Hugging Face configs and weight conversion both ways: a
checkpoint ``transformers`` saved loads into megatron-core and gives transformers'
logits; HF -> Megatron -> HF is exact, for every tensor-/pipeline-parallel cut."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from dynarl.core.errors import ConfigError  # noqa: E402
from dynarl.workers.megatron import convert  # noqa: E402
from dynarl.workers.megatron.model import (  # noqa: E402
    Architecture,
    build_gpt,
    causal_logits,
    single_process_groups,
)


def tiny_hf(family: str, *, tied: bool, seed: int) -> "transformers.PreTrainedModel":
    fields = dict(
        vocab_size=101,  # odd: padding for tensor parallelism is exercised
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    config = (
        transformers.Qwen2Config(
            **fields, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
        )
        if family == "qwen2"
        else transformers.LlamaConfig(**fields)
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random biases too (transformers initialises them to 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def groups() -> object:
    return single_process_groups()


@pytest.mark.parametrize(("family", "tied"), [("qwen2", False), ("llama", True)])
def test_a_saved_checkpoint_loads_into_megatron_with_transformers_logits(
    family: str, tied: bool, tmp_path: Path, groups: object
) -> None:
    saved = tiny_hf(family, tied=tied, seed=1)
    saved.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    arch = Architecture.from_hf_config(hf.config)
    assert (arch.qkv_bias, arch.tied_embeddings) == (family == "qwen2", tied)
    model = build_gpt(arch, groups)  # type: ignore[arg-type]
    convert.load_into(model, convert.to_megatron(dict(hf.named_parameters()), arch))
    ids = torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = causal_logits(model, ids, mask, vocab_size=arch.vocab_size)
    assert got.shape == expected.shape
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize(("family", "tied"), [("qwen2", False), ("llama", False), ("qwen2", True)])
def test_hf_to_megatron_to_hf_is_exact(family: str, tied: bool, tp: int, pp: int) -> None:
    hf = tiny_hf(family, tied=tied, seed=2)
    arch = Architecture.from_hf_config(hf.config)
    state = {n: p.detach() for n, p in hf.named_parameters()}
    stages = [
        [convert.to_megatron(state, arch, tp_rank=t, tp=tp, pp_rank=p, pp=pp) for t in range(tp)]
        for p in range(pp)
    ]
    if tied and pp > 1:  # the last stage's output layer is a copy of the embedding
        for t in range(tp):
            torch.testing.assert_close(
                stages[-1][t]["output_layer.weight"],
                stages[0][t]["embedding.word_embeddings.weight"],
                rtol=0,
                atol=0,
            )
    else:
        assert all("output_layer.weight" in s for s in stages[-1]) != tied
    if tp == 2:  # a real shard: half the heads, padded vocabulary
        first = stages[0][0]
        assert first["embedding.word_embeddings.weight"].shape == (51, 64)
        assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
    back = convert.to_hf(stages, arch)
    assert sorted(back) == sorted(state) == sorted(convert.hf_names(arch))
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_configs_it_cannot_reproduce_are_refused() -> None:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    )
    with pytest.raises(ConfigError, match="rope"):
        Architecture.from_hf_config(config)
    arch = Architecture.from_hf_config(
        transformers.Qwen2Config(num_key_value_heads=2, num_attention_heads=4)
    )
    with pytest.raises(ConfigError, match=r"actor\.tp=4"):
        arch.check_parallel(4, 1)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_tied_model_builds_every_pipeline_stage(pp: int) -> None:
    """Tied embeddings split over stages: the last stage has an output layer of its own
    (the embedding's copy), the middle ones neither, and a split is not refused."""
    arch = Architecture.from_hf_config(tiny_hf("qwen2", tied=True, seed=0).config)
    arch.check_parallel(1, pp)
    names = [set(convert.megatron_names(arch, pp_rank=p, pp=pp)) for p in range(pp)]
    assert "embedding.word_embeddings.weight" in names[0] - names[-1]
    assert "output_layer.weight" in names[-1] - names[0]
    for middle in names[1:-1]:
        assert not {n for n in middle if "embedding" in n or "output" in n}
