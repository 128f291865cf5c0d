"""Trajectories laid out as the trainer's minibatch arrays, split deterministically."""

import msgspec
import numpy as np
import pytest

from dynarl.rl.batch import (
    BatchError,
    Trajectory,
    from_completion,
    split_minibatches,
    to_arrays,
    with_advantages,
)
from dynarl.workers.rollout import Completion


def _trajectory(group: int, prompt_len: int, output_len: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(
        group_id=group,
        prompt_ids=tuple(range(10, 10 + prompt_len)),
        output_ids=tuple(range(50, 50 + output_len)),
        old_logprobs=tuple(-0.1 * (i + 1) for i in range(output_len)),
        reward=reward,
    )


def test_arrays_put_response_tokens_and_logprobs_after_the_prompt() -> None:
    trajectories = [_trajectory(0, 2, 3, 1.0), _trajectory(0, 4, 1, 0.0)]
    arrays = to_arrays(with_advantages(trajectories), pad_token_id=0)
    np.testing.assert_array_equal(arrays["input_ids"], [[10, 11, 50, 51, 52], [10, 11, 12, 13, 50]])
    np.testing.assert_array_equal(arrays["attention_mask"], [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(arrays["loss_mask"], [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    np.testing.assert_allclose(
        arrays["old_logprobs"], [[0, 0, -0.1, -0.2, -0.3], [0, 0, 0, 0, -0.1]], rtol=1e-6
    )
    assert arrays["advantages"][0] > 0 > arrays["advantages"][1]
    assert "ref_logprobs" not in arrays
    assert {k: str(v.dtype) for k, v in arrays.items()} == {
        "input_ids": "int64",
        "attention_mask": "int64",
        "loss_mask": "float32",
        "old_logprobs": "float32",
        "advantages": "float32",
    }


def test_padding_and_reference_logprobs() -> None:
    short = _trajectory(0, 1, 1)
    long = Trajectory(
        group_id=1,
        prompt_ids=(5, 6),
        output_ids=(7, 8, 9),
        old_logprobs=(-1.0, -2.0, -3.0),
        reward=0.0,
        ref_logprobs=(-1.5, -2.5, -3.5),
    )
    arrays = to_arrays([short, long], pad_token_id=3)
    np.testing.assert_array_equal(arrays["input_ids"][0], [10, 50, 3, 3, 3])
    np.testing.assert_array_equal(arrays["attention_mask"][0], [1, 1, 0, 0, 0])
    assert "ref_logprobs" not in arrays  # only when every trajectory has them
    with_ref = msgspec.structs.replace(short, ref_logprobs=(-0.7,))
    arrays = to_arrays([with_ref, long])
    np.testing.assert_allclose(arrays["ref_logprobs"][1], [0, 0, -1.5, -2.5, -3.5])
    np.testing.assert_allclose(arrays["ref_logprobs"][0], [0, -0.7, 0, 0, 0], rtol=1e-6)


def test_split_is_deterministic_by_seed_and_covers_every_sample_once() -> None:
    trajectories = [_trajectory(i // 4, 2, 1 + i % 5, reward=i) for i in range(12)]
    first = split_minibatches(trajectories, 3, seed=[7, 0])
    again = split_minibatches(trajectories, 3, seed=[7, 0])
    other = split_minibatches(trajectories, 3, seed=[7, 1])
    assert [len(mb["input_ids"]) for mb in first] == [4, 4, 4]
    for a, b in zip(first, again, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # Each sample once: its response length identifies it together with its reward.
    seen = sorted(
        float(lp) for mb in first for lp in mb["old_logprobs"][mb["loss_mask"] > 0].tolist()
    )
    expected = sorted(
        float(lp) for t in trajectories for lp in np.array(t.old_logprobs, dtype=np.float32)
    )
    assert seen == expected
    assert any(
        not np.array_equal(a["input_ids"], b["input_ids"])
        or a["input_ids"].shape != b["input_ids"].shape
        for a, b in zip(first, other, strict=True)
    )


def test_uneven_split_and_errors() -> None:
    trajectories = [_trajectory(0, 1, 1) for _ in range(5)]
    sizes = [len(mb["input_ids"]) for mb in split_minibatches(trajectories, 2, seed=0)]
    assert sorted(sizes) == [2, 3]
    with pytest.raises(BatchError, match="n_minibatches"):
        split_minibatches(trajectories, 6, seed=0)
    with pytest.raises(BatchError, match="one log-prob per output token"):
        Trajectory(group_id=0, prompt_ids=(1,), output_ids=(2, 3), old_logprobs=(0.0,), reward=0)


def test_from_completion_keeps_the_engines_logprobs() -> None:
    completion = Completion(
        request_id="r",
        prompt_ids=(2, 5),
        output_ids=(6, 1),
        output_logprobs=(-0.5, -0.25),
        finish_reason="stop",
        weight_version=3,
    )
    t = from_completion(completion, group_id=4, reward=0.5)
    assert (t.prompt_ids, t.output_ids, t.old_logprobs) == ((2, 5), (6, 1), (-0.5, -0.25))
    assert (t.group_id, t.reward, t.weight_version) == (4, 0.5, 3)


def test_loss_reads_the_same_logprobs_a_teacher_forced_forward_gives() -> None:
    """Old log-probs from a teacher-forced forward, laid out by to_arrays and read back
    by the loss, give ratio 1 on every response token: the layout and the loss agree."""
    torch = pytest.importorskip("torch")
    from dynarl.api.config import ModelConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.workers.torch.logprobs import sequence_logprobs
    from dynarl.workers.torch.model import build_model

    model = build_model(ModelConfig(hidden_size=32, num_layers=1, max_seq_len=32), seed=0)
    rng = np.random.default_rng(0)
    trajectories = []
    for group, (p, o) in enumerate([(3, 4), (1, 6), (5, 2)]):
        prompt = tuple(int(x) for x in rng.integers(4, 90, p))
        output = tuple(int(x) for x in rng.integers(4, 90, o))
        (lp,) = sequence_logprobs(model, [prompt + output], starts=[p])
        trajectories.append(
            Trajectory(
                group_id=group,
                prompt_ids=prompt,
                output_ids=output,
                old_logprobs=tuple(lp.tolist()),
                reward=float(group),
            )
        )
    arrays = to_arrays(trajectories)
    batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = GrpoLoss().terms(logits, batch)
    ratio = terms.ratio[terms.mask > 0]
    assert ratio.numel() == 12
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
