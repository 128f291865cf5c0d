"""A user's own workload and hardware in the simulator: length distributions in the
config, a hand-written trace replayed by ``dynarl sim --workload``, a measured profile
file read by ``dynarl sim --profile``; each bad input is refused naming its field."""

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from dynarl.cli import main
from dynarl.core.errors import ConfigError
from dynarl.core.ids import GroupId, ItemId
from dynarl.sim import Request, SimError, write_trace
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import simulated_run
from dynarl.sim.cpu_device import CPU_1T
from dynarl.sim.cpu_profile import cpu_profile
from dynarl.sim.lengths import Histogram, Lognormal, Mixture
from dynarl.sim.profile_file import PROFILE_VERSION, ProfileFile, read_profile, write_profile
from dynarl.sim.replay import ReplayWorkload
from dynarl.workers.config import ModelConfig

TINY = [
    "--set",
    "sim.gpu=cpu-1t",
    "--set",
    "cluster.num_devices=2",
    "--set",
    "rollout.initial_devices=1",
    "--set",
    "inference.initial_devices=0",
    "--set",
    "algorithm.old_logprobs=rollout",
    "--set",
    "run.num_iterations=2",
    "--set",
    "scheduler.mode=static-disaggregated",
]


def test_a_histogram_draws_within_its_bins_by_their_counts() -> None:
    lengths = Histogram(edges=(10, 20, 1000), counts=(3.0, 1.0)).sample(
        np.random.default_rng(0), 500, 8
    )
    assert lengths.shape == (500, 8)
    assert lengths.min() >= 10 and lengths.max() <= 1000
    assert 0.70 < np.mean(lengths < 20) < 0.80
    # correlated within a group: a group's samples land in one bin more often than chance
    short = lengths < 20
    same_bin = np.mean(short[:, 0] == short[:, 1])
    assert same_bin > 0.70  # independent draws: 0.75² + 0.25² = 0.625


def test_a_mixture_picks_one_component_per_group() -> None:
    mixture = Mixture(
        components=(
            Lognormal(median_tokens=100, group_sigma=0.0, sample_sigma=0.0),
            Lognormal(median_tokens=10_000, group_sigma=0.0, sample_sigma=0.0),
        ),
        weights=(1.0, 3.0),
    )
    lengths = mixture.sample(np.random.default_rng(1), 400, 4)
    assert set(np.unique(np.rint(lengths))) == {100.0, 10_000.0}
    assert (lengths == lengths[:, :1]).all()  # a group's samples share the component
    assert 0.70 < np.mean(lengths[:, 0] > 1000) < 0.80


def test_length_distributions_are_set_in_the_config_and_checked() -> None:
    run = simulated_run(
        {},
        ['sim.output_lengths={"kind": "histogram", "edges": [1, 50, 200], "counts": [1, 1]}'],
    )
    assert run.sim.output_lengths == Histogram(edges=(1, 50, 200), counts=(1.0, 1.0))
    with pytest.raises(ConfigError, match="one more edge than counts") as bad:
        simulated_run({}, ['sim.output_lengths={"kind": "histogram", "edges": [1], "counts": [1]}'])
    assert bad.value.field == "sim.output_lengths.edges"
    with pytest.raises(ConfigError, match="one weight per component"):
        simulated_run(
            {}, ['sim.output_lengths={"kind": "mixture", "components": [{}], "weights": []}']
        )
    with pytest.raises(ConfigError, match=r"sim\.workload=agentic set the turn statistics"):
        simulated_run({}, ["sim.workload=agentic", 'sim.output_lengths={"kind": "lognormal"}'])


def _trace(path: Path, *, iterations: int = 2, prompts: int = 2, group: int = 4) -> Path:
    requests = [
        Request(
            id=ItemId(f"{i}-{p}-{s}"),
            group=GroupId(f"{i}/{p}"),
            prompt_tokens=8,
            output_tokens=(20 + 30 * s + 5 * p,),
            iteration=i,
        )
        for i in range(iterations)
        for p in range(prompts)
        for s in range(group)
    ]
    write_trace(path, requests, meta={"source": "hand-written"})
    return path


def test_dynarl_sim_replays_a_hand_written_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "sim"
    assert main(["sim", "--workload", str(trace), "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert f"math trace {trace}" in printed and "8 sequences/iteration" in printed
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = record["result"]["iterations"][-1]
    # exactly the trace's second iteration: 2 x (20 + 50 + 80 + 110) + 5 x 4
    assert measured["generated_tokens"] == 540
    assert "lower bound" in printed


def test_a_trace_that_disagrees_with_the_job_is_refused(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "trace.jsonl")
    run = simulated_run({}, [f"sim.trace={trace}", "sim.gpu=cpu-1t"])

    with pytest.raises(SimError, match=r"set algorithm\.num_prompts=2 algorithm\.group_size=4"):
        build_cluster(run)
    requests = [
        Request(id=ItemId("a"), group=GroupId("g"), prompt_tokens=4, output_tokens=(3,)),
        Request(id=ItemId("b"), group=GroupId("g"), prompt_tokens=4, output_tokens=(3,)),
        Request(id=ItemId("c"), group=GroupId("h"), prompt_tokens=4, output_tokens=(3,)),
    ]
    with pytest.raises(SimError, match="groups of sizes"):
        ReplayWorkload.of_requests(requests, source="t.jsonl")
    with pytest.raises(SimError, match="'a' appears twice"):
        ReplayWorkload.of_requests(requests[:1] * 2, source="t.jsonl")


def _profile(path: Path, **changes: float) -> Path:
    device = msgspec.structs.replace(CPU_1T, name="my-box", **changes)
    write_profile(
        path, ProfileFile(profile_version=PROFILE_VERSION, device=device, model=ModelConfig())
    )
    return path


def test_dynarl_sim_runs_on_a_measured_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "trace.jsonl")
    fast = _profile(tmp_path / "fast.json")
    slow = _profile(tmp_path / "slow.json", decode_step_s=10 * CPU_1T.decode_step_s)
    assert read_profile(fast).device.name == "my-box"
    iteration_s = []
    for profile in (fast, slow):
        out = tmp_path / profile.stem
        args = ["sim", "--workload", str(trace), "--profile", str(profile), "--out", str(out)]
        assert main([*args, *TINY]) == 0
        assert f"my-box (profile {profile})" in capsys.readouterr().out
        record = json.loads((out / "metrics.jsonl").read_text())
        iteration_s.append(record["result"]["mean_iteration_s"])
    assert iteration_s[1] > 2 * iteration_s[0]  # the profile's costs are the ones used


def test_a_bad_profile_file_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    path.write_text("not json")
    assert main(["sim", "--profile", str(path), *TINY]) == 2
    assert "is not JSON" in capsys.readouterr().err
    path.write_text('{"profile_version": 0}')
    with pytest.raises(SimError, match="profile_version=0, this dynarl reads versions 1, 2, 3, 4"):
        read_profile(path)
    path.write_text(json.dumps({"profile_version": 1, "device": {"name": "x"}, "model": {}}))
    with pytest.raises(SimError, match=r"missing required field `decode_step_s`.*dynarl profile"):
        read_profile(path)
    with pytest.raises(SimError, match="cannot read it"):
        cpu_profile(str(tmp_path / "absent.json"))
    other = _profile(tmp_path / "other.json")
    run = simulated_run({}, [f"sim.gpu={other}", "model.hidden_size=128"])

    with pytest.raises(SimError, match="measured on the model"):
        build_cluster(run)
