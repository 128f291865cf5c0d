"""``dynarl sim --sweep``: every mode at each point of a config key's values, on the same
workload; a bad point is refused before anything is simulated."""

import json
from pathlib import Path

import pytest
from test_sim_user_inputs import TINY, _trace

from dynarl.cli import main
from dynarl.cli_sim import sweep_points
from dynarl.core.errors import ConfigError


def test_sweep_points_are_every_combination_of_the_keys_values() -> None:
    assert sweep_points([]) == [()]
    assert sweep_points(["rollout.tp=1,2", "cluster.num_devices=4, 8"]) == [
        (("rollout.tp", "1"), ("cluster.num_devices", "4")),
        (("rollout.tp", "1"), ("cluster.num_devices", "8")),
        (("rollout.tp", "2"), ("cluster.num_devices", "4")),
        (("rollout.tp", "2"), ("cluster.num_devices", "8")),
    ]
    assert sweep_points(["rollout.tp=2,2,1"]) == [(("rollout.tp", "2"),), (("rollout.tp", "1"),)]
    for bad in ("rollout.tp", "=1,2", "rollout.tp=", "rollout.tp=1,,2"):
        with pytest.raises(ConfigError, match="write KEY=V1,V2"):
            sweep_points([bad])
    with pytest.raises(ConfigError, match=r"names rollout\.tp twice"):
        sweep_points(["rollout.tp=1", "rollout.tp=2"])


def test_dynarl_sim_sweeps_a_key_over_the_same_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "sim"
    args = ["sim", "--workload", str(trace), "--out", str(out), *TINY]
    sweep = [
        "--modes",
        "static-disaggregated,static-colocated",
        "--sweep",
        "cluster.num_devices=2,4",
    ]
    assert main([*args, *sweep]) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["run"], r.get("sweep")) for r in records] == [
        (f"{m} cluster.num_devices={n}", {"cluster.num_devices": str(n)})
        for n in (2, 4)
        for m in ("static-disaggregated", "static-colocated")
    ]
    # the same requests at every point: the trace's second iteration, 540 tokens
    assert {r["result"]["iterations"][-1]["generated_tokens"] for r in records} == {540}
    mean = {r["run"]: r["result"]["mean_iteration_s"] for r in records}
    # the key took effect: each point's cluster ran at its own size
    assert mean["static-colocated cluster.num_devices=4"] != pytest.approx(
        mean["static-colocated cluster.num_devices=2"]
    )
    summary = printed[printed.index("sweep: mean iteration s") :]
    assert "cluster.num_devices=2" in summary and "cluster.num_devices=4" in summary
    best = min((2, 4), key=lambda n: mean[f"static-colocated cluster.num_devices={n}"])
    assert f"cluster.num_devices={best} (" in summary.splitlines()[3]
    for n in (2, 4):
        assert (out / f"timeline-static-colocated-cluster.num_devices={n}.png").stat().st_size


def test_a_bad_sweep_point_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim"
    args = ["sim", "--out", str(out), *TINY, "--sweep", "cluster.num_devices=2,two"]
    assert main(args) == 2
    assert "cluster.num_devices" in capsys.readouterr().err
    assert not out.exists()  # nothing was simulated, no run directory written
