"""A real run records its controller process's CPU, and ``dynarl profile --from-run``
turns it into the profile's host-tenant terms, which ``dynarl sim --profile`` charges:
the user's own run, profile and replay, as a user types them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynarl.cli import main
from dynarl.obs.metrics import read_metrics
from dynarl.sim.controller_cpu import controller_cost_of_run
from dynarl.sim.profile_file import read_profile

pytestmark = pytest.mark.slow

DYNARL = [sys.executable, "-m", "dynarl.cli"]


def test_every_iteration_records_the_controller_processs_cpu(whole: Path) -> None:
    records = read_metrics(whole / "metrics.jsonl")
    assert len(records) == 3
    for r in records:
        assert r.controller_cpu_s is not None and r.controller_cpu_s > 0
        # the iteration's CPU, not the process's since it started (imports, workers'
        # launch): within what its cores could spend over its wall time
        assert r.controller_cpu_s <= r.elapsed_s * (os.cpu_count() or 1)


def test_a_run_that_cannot_be_fitted_is_refused_before_measuring(
    whole: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "profile.json")
    refusals = {
        # 3 iterations, 2 left out: one to fit two terms on
        ("--warmup", "2"): "run.num_iterations=4",
        # the terms count only on a host-sharing curve
        ("--host-slots", "0"): "pass --host-slots 2 or more",
    }
    for extra, fix in refusals.items():
        assert main(["profile", "--from-run", str(whole), *extra, "--out", out]) == 2
        assert fix in capsys.readouterr().err
    assert main(["profile", "e2e_cpu", "--from-run", str(whole), "--out", out]) == 2
    assert "drop 'e2e_cpu'" in capsys.readouterr().err
    assert main(["profile", "--warmup", "1", "--out", out]) == 2
    assert "pass both" in capsys.readouterr().err
    assert not Path(out).exists()


@pytest.mark.timeout(400)
def test_a_profile_from_a_run_carries_its_controller_and_the_replay_charges_it(
    whole: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "profile.json"
    command = [*DYNARL, "profile", "--from-run", str(whole), "--repeat", "1"]
    done = subprocess.run(
        [*command, "--out", str(profile)], check=False, capture_output=True, text=True, timeout=360
    )
    assert done.returncode == 0, done.stderr
    assert "controller CPU fitted over 2 iterations" in done.stdout
    read = read_profile(profile)
    host = read.device.host_sharing()
    assert host is not None and host.counts_controller
    fitted = controller_cost_of_run(whole)
    assert fitted is not None
    assert host.controller_cpu_per_request_s == fitted.per_request_s
    assert host.controller_cpu_per_token_s == fitted.per_token_s
    assert "controller_cpu_per_request_s" in read.measured

    # The replay on the run's own config: its engines slower with the controller on
    # the host. The curve is pinned: a quiet host can measure two busy slots at under
    # x1.0, and the fitted terms are what is checked here.
    raw = json.loads(profile.read_text())
    raw["device"]["host_slowdown"] = [1.0, 2.0]
    with_terms, without = tmp_path / "with_terms.json", tmp_path / "without.json"
    with_terms.write_text(json.dumps(raw))
    raw["device"] |= {"controller_cpu_per_request_s": 0.0, "controller_cpu_per_token_s": 0.0}
    without.write_text(json.dumps(raw))
    rollout_s = {}
    for path in (with_terms, without):
        sim = [str(whole / "config.yaml"), "--workload", str(whole / "trace.jsonl")]
        out = tmp_path / path.stem
        assert main(["sim", *sim, "--profile", str(path), "--out", str(out)]) == 0
        line = (out / "metrics.jsonl").read_text().splitlines()[0]
        rollout_s[path.stem] = json.loads(line)["result"]["devices"]["rollout"]["busy"]
    assert rollout_s["with_terms"] > rollout_s["without"]
