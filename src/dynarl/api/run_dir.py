"""A run directory's files: ``config.yaml``, ``metrics.jsonl``, ``timeline.jsonl``,
``timeline.png``, ``predictor.json`` and ``checkpoints/``, and reading them back to
resume a run.

Every file a run rewrites is replaced atomically (a temporary file renamed), so a run
killed at any moment leaves a directory it can resume from. An open run holds the
directory's lock (``.lock``, an ``flock`` the OS releases when the process ends, however
it ends), so a second run cannot write into the same directory while the first is
open: it is refused with :class:`RunDirectoryInUseError` rather than given a fresh
directory, because the user named this one and a silently different one would be lost.
"""

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import msgspec

from dynarl.api.checkpoint import Checkpoint, ResumeError, checkpoint_to_resume
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import load_config
from dynarl.control.predictor_profile import Profile
from dynarl.core.errors import DynaRLError
from dynarl.obs.metrics import IterationStats, write_metrics
from dynarl.obs.timeline import Interval, TimelineLine, read_timeline, write_lines

logger = logging.getLogger(__name__)

PREDICTOR = "predictor.json"
"""What the scheduler's predictor learnt, in a run directory (see
:attr:`RunDirectory.predictor_path`)."""


class Resumed(msgspec.Struct, frozen=True, kw_only=True):
    """Where a resumed run starts: its checkpoint, the metrics of the iterations before
    it, and the timeline up to it."""

    checkpoint: Checkpoint
    history: list[IterationStats]
    timeline: list[TimelineLine]


class RunDirectoryInUseError(DynaRLError):
    """Another open run holds the run directory's lock."""


class RunDirectory:
    """The files of one run directory.

    Args:
        path: the directory (created when the run opens).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._warned_no_matplotlib = False
        self._torn_metrics = False

    @property
    def config_path(self) -> Path:
        """The resolved configuration (YAML)."""
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        """One JSON record per iteration."""
        return self.path / "metrics.jsonl"

    @property
    def timeline_path(self) -> Path:
        """Device -> component intervals and iteration marks (JSON lines)."""
        return self.path / "timeline.jsonl"

    @property
    def picture_path(self) -> Path:
        """The timeline's picture."""
        return self.path / "timeline.png"

    @property
    def predictor_path(self) -> Path:
        """What the scheduler's predictor learnt (a
        :class:`~dynarl.control.predictor.Profile`, written with each checkpoint)."""
        return self.path / PREDICTOR

    @property
    def lock_path(self) -> Path:
        """The lock an open run holds."""
        return self.path / ".lock"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock (creating the directory) while the block runs;
        raises :class:`RunDirectoryInUseError` if another open run holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                raise RunDirectoryInUseError(
                    f"run directory {self.path} is in use by another open run (pid "
                    f"{holder}); give this run its own directory (DynaRL(cfg, run_dir=...) "
                    "or `dynarl run --out DIR`), or wait until that run ends"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    def load_config(self, overrides: Iterable[str] = ()) -> DynaRLConfig:
        """The configuration the run was written with, with ``overrides`` applied."""
        if not self.config_path.is_file():
            raise ResumeError(
                f"{self.config_path} does not exist: pass the run directory of a run "
                "`dynarl run` (or DynaRL) wrote"
            )
        return load_config(self.config_path, overrides)

    def checkpoint(self, at: int | None = None) -> Checkpoint:
        """The checkpoint a resume starts from (the last, or the one after ``at``
        iterations), verified whole; reads only."""
        return checkpoint_to_resume(self.path, at)

    def resume_point(self, cfg: DynaRLConfig, at: int | None = None) -> Resumed:
        """The last complete checkpoint (or the one after ``at`` iterations), checked
        whole and against ``cfg``; the metrics and timeline records past it (written
        after it by a run that then stopped) are dropped from the files, so the resumed
        run appends where it left off. Nothing is written unless every check passes."""
        checkpoint = checkpoint_to_resume(self.path, at)
        state = checkpoint.state
        if state.seed != cfg.run.seed:
            raise ResumeError(
                f"the checkpoint in {self.path} was written with run.seed={state.seed}, "
                f"not {cfg.run.seed}; resume with the run's own seed (drop the override)"
            )
        done = state.num_iterations
        records = self._read_metrics() if self.metrics_path.is_file() else []
        history = [r for r in records if r.iteration < done]
        if [r.iteration for r in history] != list(range(done)):
            raise ResumeError(
                f"{self.metrics_path} holds iterations {[r.iteration for r in history]} but "
                f"the checkpoint follows iteration {done - 1}; restore the run directory's "
                "metrics.jsonl, or start a new run"
            )
        if len(history) != len(records) or self._torn_metrics:
            write_metrics(self.metrics_path, history)
        timeline: list[TimelineLine] = []
        if self.timeline_path.is_file():
            timeline = _until(read_timeline(self.timeline_path), state.timeline_s)
        return Resumed(checkpoint=checkpoint, history=history, timeline=timeline)

    def _read_metrics(self) -> list[IterationStats]:
        """``metrics.jsonl``'s records; a torn last line (a run killed while writing
        it) is dropped, a bad line before it is a :class:`ResumeError`."""
        lines = self.metrics_path.read_text(encoding="utf-8", errors="replace").splitlines()
        records: list[IterationStats] = []
        self._torn_metrics = False
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(msgspec.convert(json.loads(line), IterationStats))
            except (json.JSONDecodeError, msgspec.ValidationError) as exc:
                if number == len(lines):
                    logger.warning("%s: dropping its torn last line", self.metrics_path)
                    self._torn_metrics = True
                    break
                raise ResumeError(
                    f"{self.metrics_path} line {number} is not an iteration record ({exc}); "
                    "restore the file, or start a new run"
                ) from None
        return records

    def write_predictor(self, profile: Profile) -> None:
        """Write ``predictor.json`` (atomically)."""
        tmp = self.predictor_path.with_name(PREDICTOR + ".tmp")
        tmp.write_bytes(msgspec.json.encode(profile))
        os.replace(tmp, self.predictor_path)

    def write_timeline(self, lines: Sequence[TimelineLine], *, title: str = "") -> None:
        """Write ``timeline.jsonl``, and draw ``timeline.png`` when matplotlib is
        installed (the ``cli`` extra); without it, log once and skip the picture."""
        write_lines(self.timeline_path, lines)
        try:
            from dynarl.obs.plot import plot_timeline

            plot_timeline(lines, self.picture_path, title=title)
        except ImportError as exc:
            if not self._warned_no_matplotlib:
                logger.warning(
                    "not drawing %s (%s); install the `cli` extra for pictures",
                    self.picture_path,
                    exc,
                )
                self._warned_no_matplotlib = True


def _until(lines: Sequence[TimelineLine], end_s: float) -> list[TimelineLine]:
    """``lines`` cut at ``end_s``."""
    out: list[TimelineLine] = []
    for line in lines:
        if isinstance(line, Interval) and line.start_s < end_s:
            out.append(msgspec.structs.replace(line, end_s=min(line.end_s, end_s)))
        elif not isinstance(line, Interval) and line.time_s <= end_s:
            out.append(line)
    return out
