"""Hardware and model profiles: the published numbers the cost models stand on."""

import pytest

from dynarl.sim import GPUS, H100, MODELS, SimError, gpu, model


def test_gpu_table_is_case_insensitive_and_names_unknowns() -> None:
    assert gpu("h100") is H100
    assert set(GPUS) == {"H100", "H200", "A100"}
    with pytest.raises(SimError, match="known: H100"):
        gpu("TPUv5")


@pytest.mark.parametrize(
    ("name", "params_b", "weight_gb", "kv_bytes"),
    [
        ("Qwen2.5-1.5B", 1.54, 3.1, 28672),
        ("R1-Distill-Qwen-1.5B", 1.78, 3.55, 28672),
        ("R1-Distill-Qwen-7B", 7.62, 15.2, 57344),
        ("R1-Distill-Qwen-32B", 32.76, 65.5, 262144),
    ],
)
def test_model_sizes_match_published_figures(
    name: str, params_b: float, weight_gb: float, kv_bytes: int
) -> None:
    profile = model(name)
    assert profile.num_params / 1e9 == pytest.approx(params_b, rel=0.01)
    assert profile.weight_bytes / 1e9 == pytest.approx(weight_gb, rel=0.01)
    assert profile.kv_bytes_per_token == kv_bytes


def test_model_flops_follow_the_shape() -> None:
    m = MODELS["R1-Distill-Qwen-7B"]
    # about 2 FLOPs per parameter per token, plus attention that grows with context
    assert m.forward_flops_per_token(0) == pytest.approx(2 * m.num_params, rel=0.1)
    assert m.forward_flops_per_token(10_000) > m.forward_flops_per_token(0)
    assert m.train_flops_per_token(100) == pytest.approx(3 * m.forward_flops_per_token(100))
    assert m.prefill_flops(1000, 0) == pytest.approx(1000 * m.forward_flops_per_token(500))
    with pytest.raises(SimError, match="known"):
        model("llama-7b")
