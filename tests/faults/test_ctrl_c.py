"""Ctrl-C during `dynarl run`, as a terminal sends it (SIGINT to the whole process
group), on the default job: the run stops within seconds, prints one line and no
worker traceback, saves a checkpoint of the finished iterations, and the resume that
line suggests runs the rest."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dynarl.obs.metrics import read_metrics

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "dynarl.cli", "run"]


@pytest.mark.timeout(420)
def test_ctrl_c_stops_quickly_saves_the_finished_iterations_and_the_resume_works(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    with subprocess.Popen(
        [*CLI, "--quiet", "--out", str(run_dir), "--set", "run.num_iterations=3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:
            if line.startswith("iter   0"):
                break
        time.sleep(0.5)  # into iteration 1 (the default checkpoints only every 5)
        os.killpg(process.pid, signal.SIGINT)
        sent = time.monotonic()
        process.wait(timeout=60)
        stop_s = time.monotonic() - sent
        err = process.stderr.read()
    assert process.returncode == 130, err
    assert stop_s < 20, f"took {stop_s:.1f} s to stop"
    lines = err.splitlines()
    assert len(lines) == 1, err  # no worker tracebacks, no ExceptionGroup, no warnings
    assert "saved checkpoint" in lines[0] and f"`dynarl run --resume {run_dir}`" in lines[0]
    done = len(read_metrics(run_dir / "metrics.jsonl"))
    assert done >= 1 and (run_dir / "checkpoints" / f"iter_{done:04d}.pt").is_file()

    result = subprocess.run(
        [*CLI, "--resume", str(run_dir)], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert [s.iteration for s in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "iter_0003.pt").is_file()
