"""The data and environment sections of the configuration: where an iteration's
prompts (tasks) come from, and which environment plays them."""

from typing import Literal

from dynarl.core.config import NonNegativeInt, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError


class DataConfig(Section, frozen=True, kw_only=True):
    """Where prompts come from.

    Attributes:
        source: ``synthetic`` (the built-in task) or ``file``.
        path: JSONL or Parquet file of prompts when ``source`` is ``file``.
        shuffle: shuffle prompts each epoch (seeded by ``run.seed``).
    """

    source: Literal["synthetic", "file"] = "synthetic"
    path: str | None = None
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.source == "file" and not self.path:
            raise ConfigError(
                "data.source=file needs data.path (a JSONL or Parquet file of prompts)",
                field="data.path",
            )


class EnvConfig(Section, frozen=True, kw_only=True):
    """The environment a run's episodes play, and the limits of one episode.

    Attributes:
        name: a built-in multi-turn environment (``lookup``, ``calculator``,
            ``python-tests``; see :mod:`dynarl.envs.builtin`). ``None``: the run plays
            the environment given in code (``DynaRL(cfg, environment=...)``), or, with
            none, the single-turn bracket task scored by its verifier.
        max_turns: assistant turns an episode may take; it ends (truncated) after them.
        max_total_tokens: longest episode context (prompt, turns and observations);
            ``None``: the model's ``max_seq_len``. A turn's token budget is what is left.
        max_wall_s: an episode's wall time: checked at each turn's end, and bounding
            each environment step (a step past it ends the episode, truncated).
        max_concurrent_steps: environment steps (tool calls) running at once: the
            capacity of the run's tool component.
        warm_start_steps: before the first iteration, supervised steps of a random-init
            policy on the environment's demonstrations (a cold start teaching the
            tool-call format, as agentic RL recipes do); 0: none. Needs an environment
            with demonstrations and no ``model.path``.
        warm_start_lr: learning rate of those steps.
    """

    name: Literal["lookup", "calculator", "python-tests"] | None = None  # builtin.BuiltinName
    max_turns: PositiveInt = 8
    max_total_tokens: PositiveInt | None = None
    max_wall_s: PositiveFloat = 300.0
    max_concurrent_steps: PositiveInt = 64
    warm_start_steps: NonNegativeInt = 0
    warm_start_lr: PositiveFloat = 3e-3
