"""A real run's outputs and its resumption: a run stopped after one iteration, or
whose controller is killed (SIGKILL) mid-iteration, and resumed with `dynarl run
--resume` ends exactly as an uninterrupted run; the running object draws its timeline
and returns its metrics as flat records."""

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dynarl.api.facade import DynaRL  # noqa: E402
from dynarl.cli import main  # noqa: E402
from dynarl.control.predictor_profile import Profile  # noqa: E402
from dynarl.obs.metrics import read_metrics  # noqa: E402
from dynarl.obs.timeline import Interval, Mark, read_timeline  # noqa: E402

from .conftest import CLI, sets  # noqa: E402
from .test_facade import SMALL, config  # noqa: E402

pytestmark = pytest.mark.slow


def weights(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)["model"]
    return state


@pytest.mark.timeout(300)
async def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path: Path, whole: Path) -> None:
    first_two = read_metrics(whole / "metrics.jsonl")[:2]
    async with DynaRL(config(tmp_path / "part", *SMALL, "run.num_iterations=1")) as rl:
        await rl.run()
        # What a notebook user sees of the running object.
        figure = rl.timeline_figure()
        records = rl.metrics_records()
    bars = {
        round(path.get_extents().y0)
        for collection in figure.axes[0].collections
        for path in collection.get_paths()
    }
    assert bars == {0, 1}  # one bar per device
    assert {t.get_text() for t in figure.legends[0].get_texts()} == {"actor", "rollout"}
    assert len(records) == 1
    assert {"mean_reward", "tokens_per_s", "stage_s.rollout", "device_s.rollout"} <= set(records[0])
    assert records[0]["allocation.actor"] == 1 and records[0]["num_migrations"] == 0
    # the controller process's own CPU, recorded beside what it generated
    assert isinstance(cpu_s := records[0]["controller_cpu_s"], float) and cpu_s > 0
    run_dir = tmp_path / "part" / "run"
    assert (run_dir / "timeline.png").stat().st_size > 0
    # What the scheduler's predictor learnt, saved with the checkpoint.
    learnt = Profile.load(run_dir / "predictor.json")
    assert "actor" in learnt.components()  # the trainer's steps, at least

    # Resume as a user would; stdout is a pipe, so progress is plain lines.
    command = [sys.executable, "-m", "dynarl.cli", "run", "--resume", str(run_dir)]
    result = await anyio.run_process([*command, "--set", "run.num_iterations=2"], check=False)
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().splitlines()
    assert [line[:8] for line in lines if line.startswith("iter ")] == ["iter   1"], lines

    # The resumed run's predictor started from the first run's observations (in
    # order, then its own).
    continued = Profile.load(run_dir / "predictor.json")
    for component in learnt.components():
        before = [r for r in learnt.rows if r.component == component]
        after = [r for r in continued.rows if r.component == component]
        assert len(after) > len(before) and after[: len(before)] == before, component

    resumed = read_metrics(run_dir / "metrics.jsonl")  # appended to, not overwritten
    assert [s.iteration for s in resumed] == [0, 1]
    assert all((s.controller_cpu_s or 0.0) > 0 for s in resumed)
    assert [s.mean_reward for s in resumed] == [s.mean_reward for s in first_two]
    assert [s.gen_tokens for s in resumed] == [s.gen_tokens for s in first_two]
    np.testing.assert_allclose([s.loss for s in resumed], [s.loss for s in first_two], rtol=1e-5)
    assert resumed[-1].weight_version == first_two[-1].weight_version == 2

    ours = weights(run_dir / "checkpoints" / "iter_0002.pt")
    theirs = weights(whole / "checkpoints" / "iter_0002.pt")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-7, msg=name)

    timeline = read_timeline(run_dir / "timeline.jsonl")  # continued, in one time line
    marks = [(m.what, m.iteration) for m in timeline if isinstance(m, Mark)]
    assert marks == [
        ("iteration_start", 0),
        ("iteration_end", 0),
        ("iteration_start", 1),
        ("iteration_end", 1),
    ]
    for device in (0, 1):
        spans = sorted(
            (iv.start_s, iv.end_s)
            for iv in timeline
            if isinstance(iv, Interval) and iv.device == device
        )
        assert spans[0][0] == 0.0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap

    (run_dir / "timeline.png").unlink()
    assert main(["plot", str(run_dir)]) == 0  # `dynarl plot RUN_DIR` redraws it
    assert (run_dir / "timeline.png").stat().st_size > 0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(400)
def test_a_run_whose_controller_is_killed_resumes_to_the_uninterrupted_result(
    tmp_path: Path, whole: Path
) -> None:
    run_dir = tmp_path / "run"
    args = sets(*SMALL, "run.num_iterations=3", "run.checkpoint_every=1")
    with subprocess.Popen(
        [*CLI, "--out", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("iter   1"):  # its checkpoint is written; iteration 2 runs
                break
        # At once: on a quiet machine iteration 2 (the last) takes well under a second,
        # and a kill after it would leave nothing to resume.
        process.kill()  # the controller only: its workers must notice and exit
        process.wait(timeout=10)
    deadline = time.monotonic() + 15
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(process.pid), "a worker outlived its killed controller"

    # The killed run's lock went with it; the resume picks up its last checkpoint.
    result = subprocess.run(
        [*CLI[:-1], "--resume", str(run_dir)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    resumed = read_metrics(run_dir / "metrics.jsonl")
    expected = read_metrics(whole / "metrics.jsonl")
    assert [s.iteration for s in resumed] == [0, 1, 2]
    assert [s.mean_reward for s in resumed] == [s.mean_reward for s in expected]
    assert [s.gen_tokens for s in resumed] == [s.gen_tokens for s in expected]
    np.testing.assert_allclose([s.loss for s in resumed], [s.loss for s in expected], rtol=1e-5)
    ours = weights(run_dir / "checkpoints" / "iter_0003.pt")
    theirs = weights(whole / "checkpoints" / "iter_0003.pt")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-7, msg=name)
