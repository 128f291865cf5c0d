"""Run-directory checkpoints: what a resumed run needs, and finding the last one.

A checkpoint after ``n`` finished iterations is two files in ``RUN_DIR/checkpoints``:

- ``iter_NNNN.pt``: the actor's model and AdamW state (written by trainer rank 0);
- ``iter_NNNN.json``: the driver's :class:`RunState` (iterations done, weight version,
  the prompt sampler's position, the timeline's clock, and, with partial rollouts, the
  requests carried over to the next iteration with their partial output).

Each is written to a temporary file and renamed into place, the state last, so a
checkpoint counts only once both are whole: a run killed mid-write resumes from the
previous one. The state records the trainer file's size and SHA-256, so a file damaged
afterwards (truncated by a full disk, copied in part) is found by :func:`verify` before
a resumed run starts anything, and the error names the checkpoint to resume from
instead.
"""

import hashlib
import os
import zipfile
from pathlib import Path

import msgspec

from dynarl.core.errors import DynaRLError
from dynarl.rl.carry import CarryState
from dynarl.rl.config import AlgorithmConfig

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
        trainer_bytes: the size of the trainer's file (``None``: not recorded).
        trainer_sha256: its SHA-256, hex (``None``: not recorded).
        carried: what the last iteration carried over to the next (partial rollouts:
            the groups it did not train, their unfinished requests with every token
            generated so far), which the resumed run rolls out first.
    """

    num_iterations: int
    weight_version: int
    seed: int
    sampler: dict[str, int]
    timeline_s: float = 0.0
    trainer_bytes: int | None = None
    trainer_sha256: str | None = None
    carried: CarryState = msgspec.field(default_factory=CarryState)


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


def fingerprint(path: str | Path) -> tuple[int, str]:
    """The size and SHA-256 (hex) of the file at ``path``, as :class:`RunState` records
    them."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def damage(checkpoint: Checkpoint) -> str | None:
    """What is wrong with ``checkpoint``'s trainer file, or ``None`` if it is whole:
    its size and SHA-256 against those its state recorded, else (a checkpoint written
    before they were recorded) the CRCs of the zip archive ``torch.save`` writes."""
    path, state = checkpoint.trainer_path, checkpoint.state
    try:
        if state.trainer_bytes is not None:
            size = path.stat().st_size
            if size != state.trainer_bytes:
                return f"it holds {size} bytes, its checkpoint recorded {state.trainer_bytes}"
            if state.trainer_sha256 is not None and fingerprint(path)[1] != state.trainer_sha256:
                return "its SHA-256 is not the one its checkpoint recorded"
            return None
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            return None if bad is None else f"its member {bad!r} is corrupt"
        with open(path, "rb") as f:
            head = f.read(4)
        if head.startswith(b"PK"):
            return "it is a truncated zip archive"
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return f"it cannot be read ({exc})"
    return None


def checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """The complete checkpoints (both files present) in ``run_dir``, oldest first;
    raises :class:`ResumeError` for a state file that does not decode."""
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
    return sorted(found, key=lambda c: c.state.num_iterations)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint:
    """The complete checkpoint with the most iterations in ``run_dir``; raises
    :class:`ResumeError` when there is none."""
    found = checkpoints(run_dir)
    folder = Path(run_dir) / CHECKPOINTS
    if not found:
        raise ResumeError(
            f"{run_dir} holds no complete checkpoint ({folder}/iter_NNNN.pt with its "
            ".json); resume a run directory that `dynarl run` wrote a checkpoint to "
            "(run.checkpoint_every, or the end of a run), or start a new run"
        )
    return found[-1]


def check_carried(checkpoint: Checkpoint, algorithm: AlgorithmConfig) -> None:
    """Raise :class:`ResumeError` unless a run with ``algorithm`` can take over the
    groups ``checkpoint`` carries (partial rollouts): groups of ``group_size`` samples,
    at most ``num_prompts`` of them (an iteration may have to train them all)."""
    groups = checkpoint.state.carried.groups
    if not groups:
        return
    after = f"the checkpoint after {checkpoint.state.num_iterations} iterations"
    sizes = sorted({len(g.samples) for g in groups})
    if sizes != [algorithm.group_size]:
        raise ResumeError(
            f"{after} carries groups of {sizes[0]} samples over to the next iteration "
            f"(partial rollouts), but algorithm.group_size is {algorithm.group_size}; "
            f"resume with algorithm.group_size={sizes[0]}"
        )
    if len(groups) > algorithm.num_prompts:
        raise ResumeError(
            f"{after} carries {len(groups)} groups over to the next iteration (partial "
            f"rollouts), more than algorithm.num_prompts={algorithm.num_prompts} can "
            f"train; resume with algorithm.num_prompts={len(groups)} or more"
        )


def checkpoint_to_resume(run_dir: str | Path, at: int | None = None) -> Checkpoint:
    """The checkpoint a resume of ``run_dir`` starts from: the one after ``at``
    iterations, else the latest; verified whole (:func:`damage`). A damaged one is a
    :class:`ResumeError` naming its file and the previous whole checkpoint."""
    found = checkpoints(run_dir)
    if at is None:
        chosen = latest_checkpoint(run_dir)
    else:
        by_count = {c.state.num_iterations: c for c in found}
        if at not in by_count:
            have = ", ".join(str(n) for n in sorted(by_count)) or "none"
            raise ResumeError(
                f"{run_dir} has no complete checkpoint after {at} iterations (it has: "
                f"{have}); pick one of those"
            )
        chosen = by_count[at]
    problem = damage(chosen)
    if problem is None:
        return chosen
    earlier = [
        c
        for c in reversed(found)
        if c.state.num_iterations < chosen.state.num_iterations and damage(c) is None
    ]
    offer = (
        f"resume from the previous whole checkpoint (after {earlier[0].state.num_iterations} "
        f"iterations) with `dynarl run --resume {run_dir} --checkpoint "
        f"{earlier[0].state.num_iterations}` (DynaRL.resume(..., checkpoint="
        f"{earlier[0].state.num_iterations}))"
        if earlier
        else "no earlier whole checkpoint exists: start a new run"
    )
    raise ResumeError(f"checkpoint {chosen.trainer_path} is damaged: {problem}; {offer}")
