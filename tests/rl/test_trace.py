"""A real run's trace: each sample as the simulator's request line, appended per
iteration, cut back to a resumed run's checkpoint; a tiny real run leaves a trace
``dynarl sim --workload`` replays."""

import json
from pathlib import Path

import anyio
import pytest

from dynarl.rl.episode import Episode
from dynarl.rl.trace import RunTrace, episode_request
from dynarl.sim import read_trace
from dynarl.sim.replay import ReplayWorkload


def _response(rid: str, n: int) -> Episode:
    return Episode(
        request_id=rid, prompt_ids=(1, 2, 3), output_ids=(5,) * n, output_logprobs=(0.0,) * n
    )


def test_an_episode_becomes_its_turns_and_tool_calls() -> None:
    episode = Episode(
        request_id="0-1-2",
        prompt_ids=(1,) * 10,
        output_ids=(5,) * 17,
        output_logprobs=(0.0,) * 17,
        output_mask=(1,) * 4 + (0,) * 3 + (1,) * 6 + (0,) * 2 + (1,) * 2,
        num_turns=3,
        turn_tokens=(4, 6, 2),
        observation_tokens=(3, 2),
        step_latency_s=(0.5, 1.25),
    )
    request = episode_request(episode, iteration=7, group="7/1")
    assert (request.prompt_tokens, request.output_tokens) == (10, (4, 6, 2))
    assert request.tool_latency_s == (0.5, 1.25) and request.tool_output_tokens == (3, 2)
    assert (request.iteration, request.group, request.num_tool_calls) == (7, "7/1", 2)
    single = episode_request(_response("0-0-0", 9), iteration=0, group="0/0")
    assert (single.prompt_tokens, single.output_tokens, single.num_tool_calls) == (3, (9,), 0)


def test_iterations_are_appended_and_a_resume_drops_those_past_its_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.jsonl"

    def requests(i: int) -> list:
        return [
            episode_request(_response(f"{i}-0-{s}", 4 + s), iteration=i, group=f"{i}/0")
            for s in range(2)
        ]

    with RunTrace(path, meta={"source": "test"}) as trace:
        for i in range(3):
            trace.record(i, requests(i))
            assert len(read_trace(path).requests) == 2 * (i + 1)  # flushed as it goes
    with path.open("ab") as f:
        f.write(b'{"id": "torn')  # a run killed mid-line
    with RunTrace(path, keep_before=1, meta={"source": "resumed"}) as trace:
        trace.record(1, requests(1))
    replayed = read_trace(path)
    assert replayed.meta == {"source": "resumed"}
    assert [r.iteration for r in replayed.requests] == [0, 0, 1, 1]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_real_run_leaves_a_trace_the_simulator_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from dynarl.api.config import DynaRLConfig
    from dynarl.api.config_io import apply_overrides
    from dynarl.api.facade import DynaRL
    from dynarl.cli import main

    run_dir = tmp_path / "run"
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            "scheduler.mode=static-disaggregated",
            "run.checkpoint_every=0",
            "cluster.num_devices=2",
            "rollout.initial_devices=1",
            "inference.initial_devices=0",
            "algorithm.old_logprobs=rollout",
            "algorithm.num_prompts=8",
            "run.num_iterations=2",
            f"run.run_dir={run_dir}",
        ],
    )
    async with DynaRL(cfg) as rl:
        stats = await rl.run()
    trace = read_trace(run_dir / "trace.jsonl")
    assert trace.meta["num_prompts"] == "8" and trace.meta["group_size"] == "4"
    replay = ReplayWorkload.of_requests(trace.requests, source="trace")
    assert (replay.num_prompts, replay.group_size, len(replay.iterations)) == (8, 4, 2)
    # the trace holds what the run generated, iteration by iteration
    assert [sum(r.total_output_tokens for r in it) for it in replay.iterations] == [
        s.gen_tokens for s in stats
    ]

    out = tmp_path / "sim"
    args = ["sim", "--workload", str(run_dir / "trace.jsonl"), "--out", str(out)]
    sets = [
        "sim.gpu=cpu-1t",
        "cluster.num_devices=2",
        "rollout.initial_devices=1",
        "inference.initial_devices=0",
        "run.num_iterations=2",
    ]
    argv = [*args, *(a for s in sets for a in ("--set", s))]
    assert await anyio.to_thread.run_sync(main, argv) == 0  # the CLI runs its own loop
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["result"]["iterations"][-1]["generated_tokens"] == stats[-1].gen_tokens
