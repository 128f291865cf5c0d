"""An iteration's rollout requests: G samples per prompt, seeded per (run, iteration),
and the text a prompt and a response become on the way.

The in-process reference loop and the distributed run build their requests here, so
both sample exactly the same way for the same seed.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from dynarl.envs.prompts import Prompt
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode
from dynarl.workers.config import RolloutConfig
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams


def prompt_ids(tokenizer: Any, prompt: Prompt) -> tuple[int, ...]:
    """``prompt``'s token ids under ``tokenizer`` (a transformers tokenizer), after a
    BOS token when the tokenizer has one."""
    ids = tokenizer.encode(prompt.text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return tuple(([] if bos is None else [bos]) + list(ids))


def response_text(tokenizer: Any, completion: Completion | Episode) -> str:
    """The response text the verifier sees: the output without its final EOS."""
    ids = list(completion.output_ids)
    if completion.finish_reason == "stop" and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    assert isinstance(text, str)
    return text


def group_requests(
    algo: AlgorithmConfig,
    rollout: RolloutConfig,
    prompt_ids: Sequence[tuple[int, ...]],
    *,
    seed: int,
    iteration: int,
) -> list[GenerateRequest]:
    """``algo.group_size`` requests per prompt (ids ``"{iteration}-{p}-{g}"``), with
    ``rollout``'s sampling parameters and a seed drawn from ``(seed, iteration)``."""
    seeds = np.random.default_rng([seed, iteration]).integers(
        2**62, size=(len(prompt_ids), algo.group_size)
    )
    return [
        GenerateRequest(
            request_id=f"{iteration}-{p}-{g}",
            prompt_ids=ids,
            sampling=SamplingParams(
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                max_new_tokens=rollout.max_new_tokens,
                seed=int(seeds[p, g]),
            ),
        )
        for p, ids in enumerate(prompt_ids)
        for g in range(algo.group_size)
    ]
