"""Prompt sources and the order prompts are drawn in.

A source is either a finite list of :class:`Prompt`s (read from a JSONL or Parquet
file, or built in code) or a *generator*: a function from an index to a prompt, such as
the synthetic task's. :class:`PromptSampler` draws batches from either in a
deterministic order: a finite list is reshuffled every epoch by ``(seed, epoch)``; a
generator is read at consecutive indices. Its position is a small state dict, so a
resumed run continues with exactly the prompts it would have seen.
"""

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from dynarl.core.errors import DynaRLError
from dynarl.envs.config import DataConfig

logger = logging.getLogger(__name__)

PromptGenerator = Callable[[int], "Prompt"]
"""A source of unbounded length: the prompt at each index (a pure function of the
index, so a resumed run sees the same prompts)."""


class PromptError(DynaRLError):
    """Prompts cannot be read: a missing or malformed file, a record without a prompt,
    an unsupported format, or a state dict from another source."""


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of the task.

    Attributes:
        prompt_id: stable name of the prompt (its line or row number in a file).
        text: what the policy is asked.
        answer: the reference answer a rule-based verifier compares against, if any.
        metadata: anything else the record carried, passed through to the verifier.
    """

    prompt_id: str
    text: str
    answer: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


def read_jsonl(path: str | Path) -> list[Prompt]:
    """The prompts of a JSON-lines file: one object per line with a string ``"prompt"``,
    optional ``"answer"`` and ``"id"`` (default: the record's index) and any other
    fields (kept as metadata). Blank lines are skipped."""
    prompts: list[Prompt] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptError(f"cannot read prompts from {str(path)!r}: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{number} is not valid JSON: {exc.msg}") from exc
        prompts.append(_from_record(record, f"{path}:{number}", index=len(prompts)))
    return prompts


def read_parquet(path: str | Path) -> list[Prompt]:
    """The prompts of a Parquet file with a string column ``prompt``, optional
    ``answer`` and ``id`` columns and any others (kept as metadata). Needs ``pyarrow``."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise PromptError(
            f"reading {str(path)!r} needs pyarrow; install it with `pip install pyarrow` "
            "or convert the prompts to JSONL"
        ) from exc
    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        raise PromptError(f"cannot read prompts from {str(path)!r}: {exc}") from exc
    return [_from_record(row, f"{path} row {i}", index=i) for i, row in enumerate(rows)]


def load_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        prompts = read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        prompts = read_parquet(path)
    else:
        raise PromptError(
            f"unsupported prompt file {str(path)!r}; use JSON lines (.jsonl) or Parquet (.parquet)"
        )
    if not prompts:
        raise PromptError(f"{str(path)!r} holds no prompts; add at least one record")
    logger.info("loaded %d prompts from %s", len(prompts), path)
    return prompts


class PromptSampler:
    """Draws prompts in a deterministic, resumable order.

    Args:
        source: a finite sequence of prompts, or a :data:`PromptGenerator`.
        shuffle: reshuffle a finite source every epoch (generators are read in order).
        seed: seeds the shuffles; epoch ``e`` uses the permutation of ``(seed, e)``.
    """

    def __init__(
        self, source: Sequence[Prompt] | PromptGenerator, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        if not callable(source) and not source:
            raise PromptError("the prompt source is empty; give at least one prompt")
        self._source = source
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None

    @property
    def epoch(self) -> int:
        """Completed passes over a finite source (always 0 for a generator)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Prompts drawn in the current epoch (for a generator: drawn so far)."""
        return self._position

    def take(self, num_prompts: int) -> list[Prompt]:
        """The next ``num_prompts`` prompts, wrapping into a new epoch when needed."""
        source = self._source
        if callable(source):
            start = self._position
            self._position += num_prompts
            return [source(i) for i in range(start, start + num_prompts)]
        batch = []
        for _ in range(num_prompts):
            if self._position == len(source):
                self._epoch += 1
                self._position = 0
                self._order = None
            batch.append(source[self._epoch_order()[self._position]])
            self._position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: restore it with :meth:`load_state_dict`."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a sampler over the same
        source and seed)."""
        if int(state["seed"]) != self._seed:
            raise PromptError(
                f"the saved prompt order used seed {state['seed']} but this sampler uses "
                f"{self._seed}; resume with the run's original seed"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        limit = None if callable(self._source) else len(self._source)
        if epoch < 0 or position < 0 or (limit is not None and position > limit):
            raise PromptError(
                f"saved prompt position (epoch {epoch}, position {position}) does not fit "
                f"a source of {limit} prompts; resume with the run's original data"
            )
        self._epoch, self._position, self._order = epoch, position, None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            assert not callable(self._source)
            n = len(self._source)
            if self._shuffle:
                rng = np.random.default_rng([self._seed, self._epoch])
                self._order = [int(i) for i in rng.permutation(n)]
            else:
                self._order = list(range(n))
        return self._order


def prompt_sampler(config: DataConfig, *, seed: int, generator: PromptGenerator) -> PromptSampler:
    """The sampler of the ``data`` section: prompts from ``config.path``, or from
    ``generator`` (the environment's task, or
    :class:`~dynarl.envs.synthetic.SyntheticTask`'s) when ``config.source`` is
    ``synthetic``."""
    if config.source == "file":
        assert config.path is not None  # DataConfig checks it
        return PromptSampler(load_prompts(config.path), shuffle=config.shuffle, seed=seed)
    return PromptSampler(generator, shuffle=False, seed=seed)


def _from_record(record: object, where: str, *, index: int) -> Prompt:
    """A prompt from a file record; its id is the record's ``id`` field, else its index."""
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise PromptError(f"{where} needs a string field 'prompt'; got {record!r:.80}")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)
    prompt_id = str(record["id"]) if record.get("id") is not None else str(index)
    metadata = {k: v for k, v in record.items() if k not in ("prompt", "answer", "id")}
    return Prompt(prompt_id=prompt_id, text=record["prompt"], answer=answer, metadata=metadata)
