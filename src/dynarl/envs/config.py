"""The data section of the configuration: where an iteration's prompts come from."""

from typing import Literal

from dynarl.core.config import Section
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
