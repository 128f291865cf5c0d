"""Synthetic GRPO minibatches for tests and benchmarks that drive a trainer directly."""

import numpy as np

from dynarl.workers.trainer import Minibatch


def random_minibatch(
    seed: int, *, num_samples: int = 8, length: int = 20, prompt_len: int = 6
) -> Minibatch:
    """A deterministic minibatch of ``num_samples`` full-length rows: random tokens
    (ids 4-89, clear of the built-in tokenizer's special ids), a loss on every position
    past ``prompt_len``, old log-probs of -4 and standard-normal advantages."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((num_samples, length), dtype=np.float32)
    mask[:, prompt_len:] = 1.0
    return {
        "input_ids": rng.integers(4, 90, size=(num_samples, length)),
        "attention_mask": np.ones((num_samples, length), dtype=np.int64),
        "loss_mask": mask,
        "old_logprobs": np.full((num_samples, length), -4.0, dtype=np.float32),
        "advantages": rng.standard_normal(num_samples).astype(np.float32),
    }
