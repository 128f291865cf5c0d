"""A real run's per-request trace: ``trace.jsonl`` in its run directory.

Every finished sample becomes one :class:`~dynarl.obs.trace_records.Request` line of the
simulator's trace format (:mod:`dynarl.sim.traces`): its prompt length, the tokens
each turn generated and, between turns, how long the environment's step took and how
many tokens its observation appended. The lines of an iteration are appended and
flushed when the iteration ends, so a run killed mid-way keeps every finished
iteration's; a resumed run first drops the lines past its checkpoint.
``dynarl sim --workload RUN_DIR/trace.jsonl`` replays it.
"""

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import msgspec

from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request, TraceHeader
from dynarl.rl.episode import Episode

logger = logging.getLogger(__name__)


def episode_request(episode: Episode, *, iteration: int, group: str) -> Request:
    """``episode`` as a trace line: a single-turn response is one turn; an episode's
    turns are separated by its environment's steps (latency and observation tokens).
    A sample that never reached an engine has one turn of no token."""
    if not episode.turn_tokens:
        return Request(
            id=ItemId(episode.request_id),
            group=GroupId(group),
            prompt_tokens=len(episode.prompt_ids),
            output_tokens=(episode.num_sampled,),
            iteration=iteration,
        )
    turns = episode.turn_tokens
    calls = len(turns) - 1
    return Request(
        id=ItemId(episode.request_id),
        group=GroupId(group),
        prompt_tokens=len(episode.prompt_ids),
        output_tokens=turns,
        tool_latency_s=episode.step_latency_s[:calls],
        tool_output_tokens=episode.observation_tokens[:calls],
        tool_ok=(True,) * calls,  # a step that ran out of time ended the episode instead
        iteration=iteration,
    )


class RunTrace:
    """Appends each iteration's samples to a run directory's ``trace.jsonl``.

    Args:
        path: the file.
        keep_before: a resumed run's first iteration: the lines of this one and later
            ones (written by the run that stopped) are dropped, the earlier kept; ``None``:
            a new run, the file is started afresh.
        meta: the header's metadata (model, batch shape, ...).
    """

    def __init__(
        self, path: str | Path, *, keep_before: int | None = None, meta: Mapping[str, str]
    ) -> None:
        self.path = Path(path)
        self._keep_before = keep_before
        self._meta = dict(meta)
        self._file: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder()

    def record(self, iteration: int, samples: Iterable[Request]) -> None:
        """Append one finished iteration's samples and flush them to the file."""
        out = self._open()
        for request in samples:
            assert request.iteration == iteration, "a sample of another iteration"
            out.write(self._encoder.encode(request) + b"\n")
        out.flush()

    def _open(self) -> IO[bytes]:
        if self._file is not None:
            return self._file
        kept = [] if self._keep_before is None else self._kept_lines(self._keep_before)
        with self.path.open("wb") as out:  # the header, then what a resumed run keeps
            out.write(self._encoder.encode(TraceHeader(meta=self._meta)) + b"\n")
            out.writelines(kept)
        self._file = self.path.open("ab")
        return self._file

    def _kept_lines(self, before: int) -> list[bytes]:
        """The earlier run's lines of iterations before ``before`` (a torn or foreign
        line ends what is kept)."""
        if not self.path.is_file():
            return []
        decoder = msgspec.json.Decoder(Request)
        kept: list[bytes] = []
        lines = self.path.read_bytes().splitlines(keepends=True)
        for line in lines[1:]:
            try:
                request = decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                logger.warning("%s: dropping its lines from a torn one on", self.path)
                break
            if request.iteration < before:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
        return kept

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
