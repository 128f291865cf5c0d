"""The tiny agentic recipe: a random-init model learns, on CPU, to call a tool it
cannot do without (:mod:`dynarl.envs.lookup`: a box's code is only readable with
``open_box``).

A supervised warm start on the environment's demonstrations teaches the chat and
tool-call format first (half of them call the tool, the rest guess), as agentic RL
recipes start from a model that can write a tool call; RL then has to find that
calling pays. Episodes run as multi-turn sessions under dynamic scheduling, with the
priority-aware request queue in front of each engine.
"""

from dynarl.api.config import (
    ActorConfig,
    AlgorithmConfig,
    DynaRLConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
)


def agentic_tiny() -> DynaRLConfig:
    """The lookup environment on the default four CPU device slots: 16 tasks x 8
    episodes per iteration, at most three turns each, after a 1200-step warm start."""
    return DynaRLConfig(
        model=ModelConfig(tokenizer="chat"),
        rollout=RolloutConfig(max_new_tokens=64, request_order="priority"),
        # A warm-started policy takes smaller steps than the random-init default's.
        actor=ActorConfig(lr=3e-4),
        algorithm=AlgorithmConfig(num_prompts=16, group_size=8, n_minibatches=2),
        env=EnvConfig(name="lookup", max_turns=3, warm_start_steps=1200),
        run=RunConfig(num_iterations=12, run_dir="runs/agentic_tiny", checkpoint_every=0),
    )
