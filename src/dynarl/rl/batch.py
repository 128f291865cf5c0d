"""From rollouts to the trainer's minibatches.

A :class:`Trajectory` is one scored response: its prompt and output tokens, the
behaviour policy's log-probs of the output (what the rollout engine reported, or the
inference worker recomputed), its reward, its group (the prompt it answers) and, once
computed, its advantage. :func:`split_minibatches` shuffles an iteration's trajectories
deterministically by seed, cuts them into ``n_minibatches`` and lays each out as the
named arrays :class:`~dynarl.rl.grpo.GrpoLoss` and the trainer read:

========================  ===========  =================================================
field                     dtype        meaning (``[batch, seq]`` unless noted)
========================  ===========  =================================================
``input_ids``             int64        prompt + response, right-padded
``attention_mask``        int64        1 on real tokens
``loss_mask``             float32      1 on response tokens the policy sampled (0 on a
                                       multi-turn episode's observations)
``old_logprobs``          float32      behaviour log-prob of each response token, else 0
``advantages``            float32      ``[batch]``: one per sequence
``ref_logprobs``          float32      reference log-probs (only if every trajectory
                                       has them)
========================  ===========  =================================================
"""

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from dynarl.core.errors import DynaRLError
from dynarl.rl.advantages import Baseline, group_advantages
from dynarl.workers.rollout import Completion

Arrays = dict[str, npt.NDArray[Any]]
"""A minibatch: named arrays with the samples on dimension 0."""


class BatchError(DynaRLError):
    """Trajectories cannot form minibatches (mismatched log-probs, too few samples)."""


class Trajectory(msgspec.Struct, frozen=True, kw_only=True):
    """One scored response.

    Attributes:
        group_id: the prompt it answers; advantages compare within a group.
        prompt_ids: prompt tokens.
        output_ids: response tokens (including the EOS token when it stopped).
        old_logprobs: behaviour-policy log-prob of each output token.
        reward: the verifier's reward.
        advantage: filled in by :func:`with_advantages`.
        ref_logprobs: reference-policy log-probs of the output tokens, for a KL term.
        weight_version: oldest weight version that generated any of its tokens.
        output_mask: 1 on output tokens the policy sampled, 0 on observations (tool
            results) between a multi-turn episode's turns; ``None``: all sampled.
    """

    group_id: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    reward: float
    advantage: float = 0.0
    ref_logprobs: tuple[float, ...] | None = None
    weight_version: int = 0
    output_mask: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if self.output_mask is not None and len(self.output_mask) != n:
            raise BatchError(
                f"a trajectory of group {self.group_id} has {n} output tokens but a mask "
                f"of {len(self.output_mask)}; give one mask value per output token"
            )
        if len(self.old_logprobs) != n or (
            self.ref_logprobs is not None and len(self.ref_logprobs) != n
        ):
            raise BatchError(
                f"a trajectory of group {self.group_id} has {n} output tokens but "
                f"{len(self.old_logprobs)} old log-probs"
                + ("" if self.ref_logprobs is None else f" and {len(self.ref_logprobs)} ref")
                + "; give one log-prob per output token"
            )
        if not self.prompt_ids:
            raise BatchError(f"a trajectory of group {self.group_id} has an empty prompt")


def from_completion(
    completion: Completion,
    *,
    group_id: int,
    reward: float,
    ref_logprobs: Sequence[float] | None = None,
) -> Trajectory:
    """The trajectory of a rollout :class:`Completion`, with the engine's own log-probs
    as the behaviour policy's (they equal a teacher-forced forward at temperature 1)."""
    return Trajectory(
        group_id=group_id,
        prompt_ids=completion.prompt_ids,
        output_ids=completion.output_ids,
        old_logprobs=completion.output_logprobs,
        reward=reward,
        ref_logprobs=None if ref_logprobs is None else tuple(ref_logprobs),
        weight_version=completion.weight_version,
    )


def with_advantages(
    trajectories: Sequence[Trajectory], *, baseline: Baseline = "group-norm"
) -> list[Trajectory]:
    """``trajectories`` with their group-relative advantages filled in."""
    advantages = group_advantages(
        [t.reward for t in trajectories], [t.group_id for t in trajectories], baseline=baseline
    )
    return [
        msgspec.structs.replace(t, advantage=float(a))
        for t, a in zip(trajectories, advantages, strict=True)
    ]


def to_arrays(trajectories: Sequence[Trajectory], *, pad_token_id: int = 0) -> Arrays:
    """The minibatch arrays of ``trajectories`` (see the module docstring), padded to
    the longest sequence among them."""
    if not trajectories:
        raise BatchError("cannot build a minibatch from no trajectories")
    width = max(len(t.prompt_ids) + len(t.output_ids) for t in trajectories)
    rows = len(trajectories)
    input_ids = np.full((rows, width), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((rows, width), dtype=np.int64)
    loss_mask = np.zeros((rows, width), dtype=np.float32)
    old_logprobs = np.zeros((rows, width), dtype=np.float32)
    with_ref = all(t.ref_logprobs is not None for t in trajectories)
    ref_logprobs = np.zeros((rows, width), dtype=np.float32)
    for row, t in enumerate(trajectories):
        start, stop = len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids)
        input_ids[row, :start] = t.prompt_ids
        input_ids[row, start:stop] = t.output_ids
        attention_mask[row, :stop] = 1
        loss_mask[row, start:stop] = 1.0 if t.output_mask is None else t.output_mask
        old_logprobs[row, start:stop] = t.old_logprobs
        if with_ref and t.ref_logprobs is not None:
            ref_logprobs[row, start:stop] = t.ref_logprobs
    arrays: Arrays = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": np.array([t.advantage for t in trajectories], dtype=np.float32),
    }
    if with_ref:
        arrays["ref_logprobs"] = ref_logprobs
    return arrays


def split_minibatches(
    trajectories: Sequence[Trajectory],
    n_minibatches: int,
    *,
    seed: int | Sequence[int],
    pad_token_id: int = 0,
) -> list[Arrays]:
    """``trajectories`` shuffled by ``seed`` and cut into ``n_minibatches`` minibatches
    of equal size (differing by at most one when it does not divide), one optimizer
    step each. The same trajectories and seed always give the same minibatches."""
    if not 1 <= n_minibatches <= len(trajectories):
        raise BatchError(
            f"cannot split {len(trajectories)} trajectories into {n_minibatches} "
            "minibatches; lower algorithm.n_minibatches or generate more samples"
        )
    return [
        to_arrays([trajectories[int(i)] for i in part], pad_token_id=pad_token_id)
        for part in minibatch_indices(len(trajectories), n_minibatches, seed=seed)
    ]


def minibatch_indices(
    num_trajectories: int, n_minibatches: int, *, seed: int | Sequence[int]
) -> list[np.ndarray]:
    """The trajectory indices of each minibatch :func:`split_minibatches` makes."""
    order = np.random.default_rng(seed).permutation(num_trajectories)
    return list(np.array_split(order, n_minibatches))
