"""A run directory's files: ``config.yaml``, ``metrics.jsonl``, ``timeline.jsonl``,
``timeline.png`` and ``checkpoints/``, and reading them back to resume a run.

Every file a run rewrites is replaced atomically (a temporary file renamed), so a run
killed at any moment leaves a directory it can resume from.
"""

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from dynarl.api.checkpoint import Checkpoint, ResumeError, latest_checkpoint
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import load_config
from dynarl.obs.metrics import IterationStats, read_metrics, write_metrics
from dynarl.obs.timeline import Interval, TimelineLine, read_timeline, write_lines

logger = logging.getLogger(__name__)


class Resumed(msgspec.Struct, frozen=True, kw_only=True):
    """Where a resumed run starts: its checkpoint, the metrics of the iterations before
    it, and the timeline up to it."""

    checkpoint: Checkpoint
    history: list[IterationStats]
    timeline: list[TimelineLine]


class RunDirectory:
    """The files of one run directory.

    Args:
        path: the directory (created when the run opens).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._warned_no_matplotlib = False

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

    def load_config(self, overrides: Iterable[str] = ()) -> DynaRLConfig:
        """The configuration the run was written with, with ``overrides`` applied."""
        if not self.config_path.is_file():
            raise ResumeError(
                f"{self.config_path} does not exist: pass the run directory of a run "
                "`dynarl run` (or DynaRL) wrote"
            )
        return load_config(self.config_path, overrides)

    def resume_point(self, cfg: DynaRLConfig) -> Resumed:
        """The last complete checkpoint, checked against ``cfg``; the metrics and
        timeline records past it (written after it by a run that then stopped) are
        dropped from the files, so the resumed run appends where it left off."""
        checkpoint = latest_checkpoint(self.path)
        state = checkpoint.state
        if state.seed != cfg.run.seed:
            raise ResumeError(
                f"the checkpoint in {self.path} was written with run.seed={state.seed}, "
                f"not {cfg.run.seed}; resume with the run's own seed (drop the override)"
            )
        done = state.num_iterations
        records = read_metrics(self.metrics_path) if self.metrics_path.is_file() else []
        history = [r for r in records if r.iteration < done]
        if [r.iteration for r in history] != list(range(done)):
            raise ResumeError(
                f"{self.metrics_path} holds iterations {[r.iteration for r in history]} but "
                f"the checkpoint follows iteration {done - 1}; restore the run directory's "
                "metrics.jsonl, or start a new run"
            )
        if len(history) != len(records):
            write_metrics(self.metrics_path, history)
        timeline: list[TimelineLine] = []
        if self.timeline_path.is_file():
            timeline = _until(read_timeline(self.timeline_path), state.timeline_s)
        return Resumed(checkpoint=checkpoint, history=history, timeline=timeline)

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
