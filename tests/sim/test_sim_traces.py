"""Traces: record a workload as JSONL, replay it unchanged."""

from pathlib import Path

import numpy as np
import pytest

from dynarl.core.ids import InstanceId
from dynarl.sim import (
    H100,
    AgenticWorkload,
    EngineConfig,
    MathWorkload,
    Request,
    SimEngine,
    SimError,
    model,
    read_trace,
    write_trace,
)
from dynarl.sim.rollout import RolloutResult, run_static_rollout


def test_trace_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    requests = (
        *MathWorkload(num_prompts=8).generate(rng),
        *AgenticWorkload(num_prompts=8).generate(rng, iteration=1),
    )
    path = tmp_path / "run.jsonl"
    write_trace(path, requests, meta={"workload": "mixed", "seed": "0"})
    trace = read_trace(path)
    assert trace.requests == requests
    assert trace.meta == {"workload": "mixed", "seed": "0"}
    assert len(path.read_text().splitlines()) == len(requests) + 1


def test_bad_traces_are_rejected_with_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_trace(path, MathWorkload(num_prompts=1, group_size=2).generate(np.random.default_rng(0)))
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], '{"id": "x"}']) + "\n")
    with pytest.raises(SimError, match=r"bad.jsonl:3: not a trace line"):
        read_trace(path)
    path.write_text("\n".join(lines[1:]) + "\n")  # no header
    with pytest.raises(SimError, match=":1: not a trace line"):
        read_trace(path)
    path.write_text('{"trace_version": 99}\n')
    with pytest.raises(SimError, match="version 99"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(SimError, match="empty"):
        read_trace(path)


def test_replaying_a_trace_reproduces_the_rollout(tmp_path: Path) -> None:
    config = EngineConfig(gpu=H100, model=model("R1-Distill-Qwen-1.5B"))
    requests = AgenticWorkload(num_prompts=16).generate(np.random.default_rng(4))
    write_trace(tmp_path / "t.jsonl", requests)
    replayed = read_trace(tmp_path / "t.jsonl").requests

    def run(reqs: tuple[Request, ...]) -> RolloutResult:
        engines = [SimEngine(config, instance=InstanceId(f"e{i}")) for i in range(4)]
        return run_static_rollout(reqs, engines)

    assert run(replayed) == run(requests)
