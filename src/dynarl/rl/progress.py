"""What the pipeline driver tells the outside while an iteration runs: its progress,
and the weight-sync group it asks to move the engines' weights."""

from typing import Protocol

import msgspec


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Where the running iteration is (for a progress display).

    Attributes:
        iteration: 0-based index.
        stage: ``rollout``, ``train`` or ``sync``.
        done, total: responses finished out of those requested (rollout), or
            optimizer steps taken out of ``n_minibatches`` (train).
    """

    iteration: int
    stage: str
    done: int
    total: int


class Weights(Protocol):
    """Where the engines' weights come from: the run's weight-sync group."""

    def trainer_moves_ahead(self) -> None:
        """The trainer is about to step: its weights move past the engines'."""
        ...

    async def sync_weights(self, version: int) -> int:
        """Give every serving engine the trainer's weights as ``version``."""
        ...
