"""Run-directory checkpoints: what a resumed run needs, and finding the last one.

A checkpoint after ``n`` finished iterations is two files in ``RUN_DIR/checkpoints``:

- ``iter_NNNN.pt``: the actor's model and AdamW state (written by trainer rank 0);
- ``iter_NNNN.json``: the driver's :class:`RunState` (iterations done, weight version,
  the prompt sampler's position, the timeline's clock).

Each is written to a temporary file and renamed into place, the state last, so a
checkpoint counts only once both are whole: a run killed mid-write resumes from the
previous one.
"""

import os
from pathlib import Path

import msgspec

from dynarl.core.errors import DynaRLError

CHECKPOINTS = "checkpoints"
"""The checkpoints' folder in a run directory."""


class ResumeError(DynaRLError):
    """A run cannot be resumed from a directory: no config, no complete checkpoint, or
    a checkpoint that does not fit the configuration."""


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    """The driver's side of a checkpoint.

    Attributes:
        num_iterations: iterations finished (the index of the next one).
        weight_version: the weight version the engines held.
        seed: ``run.seed`` of the run that wrote it.
        sampler: the prompt sampler's ``state_dict()``.
        timeline_s: seconds since the run first started (across resumes), so a
            resumed run's timeline continues where this one stopped.
    """

    num_iterations: int
    weight_version: int
    seed: int
    sampler: dict[str, int]
    timeline_s: float = 0.0


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A complete checkpoint: the trainer's file and the driver's state."""

    trainer_path: Path
    state: RunState


def trainer_path(run_dir: str | Path, num_iterations: int) -> Path:
    """Where the trainer state after ``num_iterations`` iterations goes."""
    return Path(run_dir) / CHECKPOINTS / f"iter_{num_iterations:04d}.pt"


def write_state(run_dir: str | Path, state: RunState) -> Path:
    """Write ``state`` beside its trainer file (atomically; write the trainer file
    first: this one marks the checkpoint complete). Returns its path."""
    path = trainer_path(run_dir, state.num_iterations).with_suffix(".json")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)
    return path


def latest_checkpoint(run_dir: str | Path) -> Checkpoint:
    """The complete checkpoint with the most iterations in ``run_dir``; raises
    :class:`ResumeError` when there is none."""
    folder = Path(run_dir) / CHECKPOINTS
    found: list[Checkpoint] = []
    for state_path in folder.glob("iter_*.json"):
        pt = state_path.with_suffix(".pt")
        if not pt.is_file():
            continue
        try:
            state = msgspec.json.decode(state_path.read_bytes(), type=RunState)
        except msgspec.DecodeError as exc:
            raise ResumeError(
                f"{state_path} is not a checkpoint state ({exc}); delete it to resume from "
                "an earlier checkpoint"
            ) from exc
        found.append(Checkpoint(trainer_path=pt, state=state))
    if not found:
        raise ResumeError(
            f"{run_dir} holds no complete checkpoint ({folder}/iter_NNNN.pt with its "
            ".json); resume a run directory that `dynarl run` wrote a checkpoint to "
            "(run.checkpoint_every, or the end of a run), or start a new run"
        )
    return max(found, key=lambda c: c.state.num_iterations)
