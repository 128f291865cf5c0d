"""A resume that cannot work fails before anything starts or is written: a damaged
checkpoint is named with the previous whole one to resume from, a torn metrics line
left by a killed run is dropped, a bad one before it is refused; and a run directory
an open run holds cannot be written by a second run."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from dynarl.api.checkpoint import (
    ResumeError,
    RunState,
    checkpoint_to_resume,
    fingerprint,
    trainer_path,
    write_state,
)
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, dump_config
from dynarl.api.facade import DynaRL
from dynarl.api.run_dir import RunDirectory, RunDirectoryInUseError
from dynarl.cli import main
from dynarl.obs.metrics import MetricsWriter, read_metrics

from .test_run_dir import stats


def whole_checkpoint(run_dir: Path, done: int, *, recorded: bool = True) -> Path:
    """A checkpoint whose trainer file is a zip archive, as torch.save writes."""
    path = trainer_path(run_dir, done)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", bytes(range(256)) * 64 * (done + 1))
    size, sha = fingerprint(path)
    write_state(
        run_dir,
        RunState(
            num_iterations=done,
            weight_version=done,
            seed=0,
            sampler={"epoch": 0, "position": 16 * done, "seed": 0},
            trainer_bytes=size if recorded else None,
            trainer_sha256=sha if recorded else None,
        ),
    )
    return path


def a_run_directory(tmp_path: Path, *, recorded: bool = True) -> Path:
    dump_config(
        apply_overrides(DynaRLConfig(), ["run.num_iterations=20"]), tmp_path / "config.yaml"
    )
    with MetricsWriter(tmp_path / "metrics.jsonl") as writer:
        for i in range(10):
            writer.write(stats(i))
    for done in (5, 10):
        whole_checkpoint(tmp_path, done, recorded=recorded)
    return tmp_path


def test_fingerprint_is_size_and_sha256(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc" * 1000)
    assert fingerprint(path) == (3000, hashlib.sha256(b"abc" * 1000).hexdigest())


@pytest.mark.parametrize("recorded", [True, False], ids=["fingerprinted", "older-zip-check"])
@pytest.mark.parametrize("harm", ["truncate", "flip"])
def test_a_damaged_newest_checkpoint_names_the_file_and_offers_the_previous(
    tmp_path: Path, recorded: bool, harm: str
) -> None:
    run_dir = a_run_directory(tmp_path, recorded=recorded)
    newest = trainer_path(run_dir, 10)
    data = bytearray(newest.read_bytes())
    if harm == "truncate":
        newest.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[100] ^= 0xFF  # inside the stored member: its CRC no longer matches
        newest.write_bytes(bytes(data))
    with pytest.raises(ResumeError) as caught:
        checkpoint_to_resume(run_dir)
    message = str(caught.value)
    assert str(newest) in message and "is damaged" in message
    assert f"--resume {run_dir} --checkpoint 5" in message
    assert checkpoint_to_resume(run_dir, 5).state.num_iterations == 5
    with pytest.raises(ResumeError, match=r"no complete checkpoint after 7 iterations.*5, 10"):
        checkpoint_to_resume(run_dir, 7)


async def test_a_damaged_checkpoint_stops_a_resume_before_anything_starts_or_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = a_run_directory(tmp_path)
    newest = trainer_path(run_dir, 10)
    newest.write_bytes(newest.read_bytes()[:-10])
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    rl = DynaRL.resume(run_dir, ["run.num_iterations=30"])
    with pytest.raises(ResumeError, match="is damaged"):
        async with rl:
            pass
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume {run_dir} --checkpoint 5" in err
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # config.yaml, metrics: nothing rewritten, no lock left


def test_a_torn_last_metrics_line_is_dropped_and_a_bad_earlier_one_refused(
    tmp_path: Path,
) -> None:
    run_dir = a_run_directory(tmp_path)
    files = RunDirectory(run_dir)
    with files.metrics_path.open("a") as f:
        f.write('{"iteration": 10, "mean_rew')  # killed while writing iteration 10's line
    resumed = files.resume_point(DynaRLConfig(), 10)
    assert [s.iteration for s in resumed.history] == list(range(10))
    assert [s.iteration for s in read_metrics(files.metrics_path)] == list(range(10))
    lines = files.metrics_path.read_text().splitlines()
    lines[3] = lines[3][:20]
    files.metrics_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ResumeError, match=r"metrics\.jsonl line 4 is not an iteration record"):
        files.resume_point(DynaRLConfig(), 10)


async def test_a_second_run_in_an_open_run_directory_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    run_dir = a_run_directory(tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()
    cfg = apply_overrides(DynaRLConfig(), [f"run.run_dir={run_dir}"])
    with RunDirectory(run_dir).lock():  # what an open run holds
        for rl in (DynaRL(cfg), DynaRL.resume(run_dir)):
            with pytest.raises(RunDirectoryInUseError, match=r"in use by another open run"):
                async with rl:
                    pass
        assert (run_dir / "metrics.jsonl").read_bytes() == before
    with RunDirectory(run_dir).lock():  # released when its holder closes
        pass
