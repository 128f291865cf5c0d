"""The RL algorithm's section of the configuration: batch shape, minibatches and the
GRPO loss's settings."""

from typing import Annotated, Literal

import msgspec

from dynarl.core.config import NonNegativeInt, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError


class AlgorithmConfig(Section, frozen=True, kw_only=True):
    """The RL algorithm: GRPO (group-normalised advantages, the PPO clipped loss).

    Attributes:
        num_prompts: prompts per iteration.
        group_size: responses sampled per prompt (G).
        n_minibatches: optimizer steps per iteration.
        clip_eps: PPO clip range of the importance ratio.
        kl_coef: weight of the KL penalty to the reference policy (0 disables it).
        loss_agg: ``token-mean`` or ``seq-mean`` loss aggregation.
        minibatch_order: ``seeded``: the iteration's samples are split into minibatches
            by a seeded permutation once every response is in (the same split in every
            scheduling mode, so modes learn exactly the same); ``completion``: whole
            groups form minibatches in the order they finish, and the actor takes its
            first optimizer steps while the rollout tail still runs (PPO on the same
            behaviour policy, in another data order; needs ``num_prompts`` divisible
            by ``n_minibatches``).
        old_logprobs: where the behaviour policy's log-probs (the PPO ratio's
            denominator) come from: ``inference``: recomputed by the inference stage
            with the trainer's numerics (needed when the engines' differ, as SGLang's
            do from Megatron's); ``rollout``: the engines' own, as they sampled (no
            inference stage: less work, as slime's and verl's rollout log-probs).
        over_sample_prompts: partial rollouts (APRIL; slime's ``--partial-rollout``
            with over-sampling; Kimi k1.5's): each iteration's rollout runs this many
            groups beyond ``num_prompts`` and ends as soon as ``num_prompts`` groups are
            whole; the unfinished ones are aborted, keep every token generated, and
            carry into the next iteration, where they resume first (re-prefilled,
            decoded on by the new policy). It cuts the rollout's thin tail (the longest
            responses decode alongside the next batch) at the price of training some
            samples whose early tokens an older policy generated (``max_staleness``
            bounds it; each iteration reports it). At most ``num_prompts``. With a
            multi-turn environment an unfinished episode carries over mid-session: its
            environment stays alive and its next turn resumes in the next iteration. 0
            (the default): every iteration generates and trains its own
            ``num_prompts`` groups, fully on-policy.
        max_staleness: with ``over_sample_prompts``, the most policy versions a
            trained sample's oldest token may lag: a group carried this many times
            must finish in its iteration (the rollout waits for it). Default 1.
    """

    num_prompts: PositiveInt = 16
    group_size: PositiveInt = 4
    n_minibatches: PositiveInt = 2
    clip_eps: PositiveFloat = 0.2
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    minibatch_order: Literal["seeded", "completion"] = "seeded"
    old_logprobs: Literal["inference", "rollout"] = "inference"
    over_sample_prompts: NonNegativeInt = 0
    max_staleness: PositiveInt | None = None

    def __post_init__(self) -> None:
        if self.over_sample_prompts > self.num_prompts:
            raise ConfigError(
                f"algorithm.over_sample_prompts ({self.over_sample_prompts}) may not exceed "
                f"num_prompts ({self.num_prompts}): more groups carried over than an "
                "iteration trains could hold more due groups than it can train; lower it",
                field="algorithm.over_sample_prompts",
            )
        if self.max_staleness is not None and not self.over_sample_prompts:
            raise ConfigError(
                "algorithm.max_staleness bounds partial rollouts, which are off "
                "(algorithm.over_sample_prompts=0); set over_sample_prompts to the groups "
                "to run beyond num_prompts, or drop max_staleness",
                field="algorithm.max_staleness",
            )
        if self.minibatch_order == "completion" and self.num_prompts % self.n_minibatches:
            raise ConfigError(
                f"algorithm.minibatch_order=completion forms minibatches of whole groups, "
                f"so num_prompts ({self.num_prompts}) must be a multiple of n_minibatches "
                f"({self.n_minibatches}); change one of them or use minibatch_order=seeded",
                field="algorithm.minibatch_order",
            )

    @property
    def samples_per_iteration(self) -> int:
        """Sequences generated per iteration."""
        return self.num_prompts * self.group_size

    @property
    def partial_rollouts(self) -> bool:
        """Whether rollouts over-sample and carry unfinished groups over."""
        return self.over_sample_prompts > 0

    @property
    def staleness_bound(self) -> int:
        """How many times a group may be carried over (0 without partial rollouts)."""
        if not self.over_sample_prompts:
            return 0
        return 1 if self.max_staleness is None else self.max_staleness

    @property
    def samples_per_minibatch(self) -> int:
        """Sequences per optimizer step."""
        return self.samples_per_iteration // self.n_minibatches
