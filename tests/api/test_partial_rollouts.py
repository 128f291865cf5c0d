"""Partial rollouts in a real run (``algorithm.over_sample_prompts``): every iteration
trains exactly ``num_prompts`` groups, the requests it cut resume in the next one with
every token they had (the old weights' tokens, then the new weights'), nothing trained
is staler than ``max_staleness``, the iteration's stats say so, and a checkpoint keeps
what is carried, so a resumed run resumes it. A multi-turn episode carries over
mid-session, its environment alive, and resumes where it stopped; a resumed run
restarts it."""

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import anyio
import msgspec
import pytest

from dynarl.api.checkpoint import RunState, checkpoints, write_state
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.control.topology import ROLLOUT
from dynarl.core.ids import GroupId
from dynarl.envs.environment import ChatMessage, EnvironmentSpec, StepResult, Turn
from dynarl.envs.prompts import Prompt
from dynarl.obs.metrics import IterationStats, PartialRolloutStats, flat_record
from dynarl.rl.carry import CarriedGroup, CarryState, FinishedSample, OpenEpisode, PartialSample
from dynarl.rl.episode import Episode
from dynarl.workers.rollout import GenerateRequest

NUM_PROMPTS, OVER, GROUP = 4, 2, 4
PARTIAL = [
    "scheduler.mode=static-disaggregated",
    "cluster.num_devices=3",
    "rollout.initial_devices=1",
    "inference.initial_devices=1",  # old log-probs from inference: carried ones re-scored
    f"algorithm.num_prompts={NUM_PROMPTS}",
    f"algorithm.group_size={GROUP}",
    f"algorithm.over_sample_prompts={OVER}",
    "algorithm.max_staleness=1",
    # Long enough that the groups finish at different times; requests beyond an
    # engine's batch wait in its queue (those leave at once when the rollout ends).
    "rollout.max_new_tokens=256",
    "rollout.max_running_requests=8",
    "run.checkpoint_every=1",
]


def test_a_checkpoint_keeps_the_carried_requests_with_their_tokens(tmp_path: Path) -> None:
    request = GenerateRequest(
        request_id="3-1-0",
        prompt_ids=(5, 6),
        output_ids=(7, 8, 9),
        output_logprobs=(-0.5, -1.25, -3.0),
        weight_version=3,
    )
    done = Episode(request_id="3-1-1", prompt_ids=(5, 6), output_ids=(4,), output_logprobs=(-0.1,))
    carried = CarryState(
        groups=(
            CarriedGroup(
                group=GroupId("3/1"),
                prompt=Prompt(prompt_id="17", text="(()", answer=")"),
                times_carried=1,
                samples=(PartialSample(request=request), FinishedSample(response=done, reward=1.0)),
            ),
        )
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "iter_0004.pt").write_bytes(b"weights")
    state = RunState(num_iterations=4, weight_version=4, seed=0, sampler={}, carried=carried)
    write_state(tmp_path, state)
    [checkpoint] = checkpoints(tmp_path)
    assert checkpoint.state.carried == carried
    # A checkpoint written before partial rollouts carries nothing.
    old = msgspec.json.decode(b'{"num_iterations":1,"weight_version":1,"seed":0,"sampler":{}}')
    assert msgspec.convert(old, RunState).carried == CarryState()


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.group_size=2"], "resume with algorithm.group_size=4"),
        (
            ["algorithm.num_prompts=1", "algorithm.over_sample_prompts=1"],
            "resume with algorithm.num_prompts=2 or more",
        ),
    ],
)
async def test_a_resume_that_cannot_take_over_the_carried_groups_fails_before_it_starts(
    tmp_path: Path, overrides: list[str], says: str
) -> None:
    from dynarl.api.checkpoint import ResumeError, fingerprint, trainer_path
    from dynarl.api.config_io import dump_config
    from dynarl.api.facade import DynaRL

    dump_config(apply_overrides(DynaRLConfig(), PARTIAL), tmp_path / "config.yaml")
    path = trainer_path(tmp_path, 1)
    path.parent.mkdir()
    path.write_bytes(b"weights")
    size, sha = fingerprint(path)
    samples = tuple(
        PartialSample(request=GenerateRequest(request_id=f"0-{p}-{g}", prompt_ids=(1,)))
        for p in range(2)
        for g in range(GROUP)
    )
    carried = CarryState(
        groups=tuple(
            CarriedGroup(
                group=GroupId(f"0/{p}"),
                prompt=Prompt(prompt_id=str(p), text="("),
                times_carried=1,
                samples=samples[p * GROUP : (p + 1) * GROUP],
            )
            for p in range(2)
        )
    )
    state = RunState(
        num_iterations=1,
        weight_version=1,
        seed=0,
        sampler={},
        trainer_bytes=size,
        trainer_sha256=sha,
        carried=carried,
    )
    write_state(tmp_path, state)
    before = _files(tmp_path)
    with pytest.raises(ResumeError, match=says):
        async with DynaRL.resume(tmp_path, overrides):
            pass
    assert _files(tmp_path) == before  # nothing written, no lock left


def test_flat_records_take_the_partial_rollout_apart_and_leave_it_out_when_off() -> None:
    fields = {
        "iteration": 0,
        "mean_reward": 0.5,
        "solved_fraction": 0.0,
        "num_samples": 16,
        "gen_tokens": 100,
        "mean_response_tokens": 6.0,
        "tokens_per_s": 10.0,
        "loss": 0.1,
        "grad_norm": 1.0,
        "weight_version": 1,
        "stage_s": {},
        "elapsed_s": 1.0,
    }
    on_policy = msgspec.convert(fields, IterationStats)
    assert not [key for key in flat_record(on_policy) if key.startswith("partial_rollout")]
    partial = msgspec.structs.replace(
        on_policy,
        partial_rollout=PartialRolloutStats(
            num_carried_in=8,
            num_resumed=2,
            num_carried_out=8,
            max_times_carried=1,
            max_weight_lag=1,
            stale_token_fraction=0.5,
        ),
    )
    record = flat_record(partial)
    assert record["partial_rollout.max_weight_lag"] == 1
    assert record["partial_rollout.stale_token_fraction"] == 0.5


def _groups(ids: list[str]) -> set[str]:
    return {rid.rsplit("-", 1)[0] for rid in ids}


def _finished_lengths(rl: Any, before: CarryState, *, carried: bool = True) -> list[int]:
    """The sampled tokens of every response the iteration's rollout finished (sorted):
    those it trains and, with ``carried``, those it carries over finished, less those
    that came in finished (``before``)."""
    pipeline = rl._pipeline
    came_finished = {
        s.response.request_id
        for g in before.groups
        for s in g.samples
        if isinstance(s, FinishedSample)
    }
    finished = [e for e in pipeline.trained if e.request_id not in came_finished]
    if carried:
        finished += [
            s.response
            for g in pipeline.carried.groups
            for s in g.samples
            if isinstance(s, FinishedSample) and s.response.request_id not in came_finished
        ]
    return sorted(e.num_sampled for e in finished)


def _learnt_lengths(rl: Any) -> list[int]:
    """The response lengths the controller learnt in the iteration (sorted): a resumed
    request's or episode's whole output, its partial output included (the router item
    states it)."""
    return sorted(rl.controller.graph.components[ROLLOUT].lengths_iter)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_cut_requests_resume_with_their_tokens_and_training_stays_within_staleness(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from dynarl.api.facade import DynaRL
    from dynarl.obs.metrics import read_metrics

    run_dir = tmp_path / "run"
    cfg = apply_overrides(
        DynaRLConfig(), [*PARTIAL, "run.num_iterations=3", f"run.run_dir={run_dir}"]
    )
    resumed_with_tokens = 0
    carried = CarryState()

    def check_resumed(before: CarryState, trained: list[Episode], iteration: int) -> int:
        """Every carried sample is trained now (max_staleness=1: they are due), each
        output the carried one and more: no token lost or repeated."""
        by_id = {e.request_id: e for e in trained}
        num = 0
        for group in before.groups:
            for s in group.samples:
                final = by_id[s.request_id]
                if isinstance(s, PartialSample):
                    kept = s.request.output_ids
                    assert final.output_ids[: len(kept)] == kept, s.request_id
                    assert final.output_logprobs[: len(kept)] == s.request.output_logprobs
                    if kept:
                        num += 1
                        assert final.weight_version == s.request.weight_version == iteration - 1
                else:
                    assert final == s.response
        return num

    async with DynaRL(cfg) as rl:
        history = []
        async for stats in rl.iterations():
            pipeline = rl._pipeline
            assert pipeline is not None
            resumed_with_tokens += check_resumed(carried, pipeline.trained, stats.iteration)
            assert _learnt_lengths(rl) == _finished_lengths(rl, carried)
            # The controller heard which groups the rollout had to complete: the carried
            # ones (due, at max_staleness=1) and how many others.
            assert rl.controller is not None
            assert rl.controller.graph.groups_due == {g.group for g in carried.groups}
            assert rl.controller.graph.groups_to_complete is not None
            carried = pipeline.carried
            history.append(stats)
            assert len(pipeline.trained) == NUM_PROMPTS * GROUP == stats.num_samples
            assert len(_groups([e.request_id for e in pipeline.trained])) == NUM_PROMPTS
            assert len(carried.groups) == OVER
        assert rl.controller is not None
        assert rl.controller.statistics().events_rejected == {}
        rl.controller.graph.check()
    saved = checkpoints(run_dir)[-1].state
    assert saved.num_iterations == 3 and saved.carried == carried

    for stats in history:
        p = stats.partial_rollout
        assert p is not None and p.num_carried_out == OVER * GROUP
        assert p.max_times_carried <= 1 and p.max_weight_lag <= 1
        assert p.num_carried_in == (0 if stats.iteration == 0 else OVER * GROUP)
    assert any(s.partial_rollout and s.partial_rollout.stale_token_fraction > 0 for s in history)
    assert read_metrics(run_dir / "metrics.jsonl") == history

    # Resumed from its checkpoint, the run rolls out what was carried first.
    async with DynaRL.resume(run_dir, ["run.num_iterations=4"]) as rl:
        assert rl._pipeline is not None and rl._pipeline.carried == carried
        [stats] = [s async for s in rl.iterations()]
        resumed_with_tokens += check_resumed(carried, rl._pipeline.trained, stats.iteration)
        assert _learnt_lengths(rl) == _finished_lengths(rl, carried)
    assert stats.iteration == 3 and stats.partial_rollout is not None
    assert stats.partial_rollout.num_carried_in == carried.num_samples
    assert resumed_with_tokens > 0  # some requests really were cut mid-response


class Relay:
    """A multi-turn environment whatever the policy says: each turn gets an
    observation back after a short tool latency; task ``i`` ends after ``1 + i % 6``
    turns, so groups take different times and the longest carry over mid-session. The
    reward is the share of turns that stopped on their own. It counts the environments
    made and closed."""

    made: ClassVar[int] = 0
    closed: ClassVar[int] = 0
    slow_s: ClassVar[float] = 0.05
    """How long the steps after the first of six-turn tasks take."""
    steps: ClassVar[list[tuple[float, float]]] = []
    """When each step started and ended (``time.monotonic``)."""

    def __init__(self) -> None:
        Relay.made += 1
        self.stopped: list[float] = []
        self.turns = 0

    @property
    def tools(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Prompt) -> list[ChatMessage]:
        self.turns = 1 + int(task.prompt_id[1:]) % 6
        return [{"role": "user", "content": task.text}]

    async def step(self, turn: Turn) -> StepResult:
        start = time.monotonic()
        await anyio.sleep(self.slow_s if self.turns == 6 and turn.index > 0 else 0.05)
        Relay.steps.append((start, time.monotonic()))
        self.stopped.append(float(turn.finish_reason == "stop"))
        return StepResult(
            observation=({"role": "user", "content": "go on"},),
            reward=sum(self.stopped) / self.turns,
            done=len(self.stopped) == self.turns,
        )

    async def close(self) -> None:
        Relay.closed += 1


RELAY = EnvironmentSpec(make=Relay, task=lambda i: Prompt(prompt_id=f"r{i}", text=f"task {i}"))
EPISODES = [
    *PARTIAL,
    "rollout.max_new_tokens=16",
    "model.tokenizer=chat",
    "env.max_turns=8",
    "run.num_iterations=3",
]
"""Relay's episodes, three iterations of them."""


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_episodes_carry_over_mid_session_and_resume_where_they_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch")
    from dynarl.api.facade import DynaRL

    run_dir = tmp_path / "run"
    cfg = apply_overrides(
        DynaRLConfig(),
        [*EPISODES, f"run.run_dir={run_dir}"],
    )
    Relay.made = Relay.closed = 0
    carried = CarryState()
    resumed_mid_session = 0
    async with DynaRL(cfg, environment=RELAY) as rl:
        async for stats in rl.iterations():
            pipeline = rl._pipeline
            assert pipeline is not None
            by_id = {e.request_id: e for e in pipeline.trained}
            for group in carried.groups:  # due at max_staleness=1: trained now
                for sample in group.samples:
                    final = by_id[sample.request_id]
                    if isinstance(sample, OpenEpisode):
                        assert final.num_sampled >= sample.num_tokens
                        if sample.num_tokens:
                            resumed_mid_session += 1
                            assert final.weight_version == stats.iteration - 1
                    elif isinstance(sample, FinishedSample):
                        assert final == sample.response
            assert len(pipeline.trained) == NUM_PROMPTS * GROUP == stats.num_samples
            assert all(e.end != "aborted" and 1 <= e.num_turns <= 6 for e in pipeline.trained)
            # (Episodes a step ended after the withdrawal never complete in the router.)
            trained = Counter(_finished_lengths(rl, carried, carried=False))
            assert not trained - Counter(_learnt_lengths(rl))
            carried = pipeline.carried
            assert len(carried.groups) == OVER
            assert stats.partial_rollout is not None
            assert stats.partial_rollout.max_weight_lag <= 1
            assert stats.episodes["aborted"] == 0
        assert rl.controller is not None
        assert rl.controller.statistics().events_rejected == {}
        rl.controller.graph.check()
        assert pipeline.runner is not None
        late = await pipeline.runner.settle()  # steps the last iteration left running
        playing = pipeline.runner.num_playing
    assert resumed_mid_session > 0  # some episodes really were cut mid-session
    # The longest tasks' groups carry over at the end too, mid-session, still playing.
    open_left = [s for g in carried.groups for s in g.samples if isinstance(s, OpenEpisode)]
    assert open_left and playing + len(late) == len(open_left)
    assert set(late) <= {s.request_id for s in open_left}
    assert Relay.closed == Relay.made  # every environment closed once, parked ones too
    assert checkpoints(run_dir)[-1].state.carried == carried

    # Resumed from its checkpoint, the run restarts the episodes that were mid-session
    # (their environments are gone) from their first turn, and trains them whole.
    caplog.set_level(logging.WARNING, logger="dynarl.rl.iteration")
    async with DynaRL.resume(run_dir, ["run.num_iterations=4"], environment=RELAY) as rl:
        [stats] = [s async for s in rl.iterations()]
        assert rl._pipeline is not None
        by_id = {e.request_id: e for e in rl._pipeline.trained}
    assert f"{len(open_left)} episodes carried over mid-session restart" in caplog.text
    for group in carried.groups:
        turns = 1 + int(group.prompt.prompt_id[1:]) % 6
        for sample in group.samples:
            final = by_id[sample.request_id]
            if isinstance(sample, OpenEpisode):
                assert final.num_turns == turns and final.weight_version == 3
    assert stats.num_samples == NUM_PROMPTS * GROUP
    assert stats.partial_rollout is not None and stats.partial_rollout.num_resumed == 0
    assert Relay.closed == Relay.made


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_tool_call_running_at_an_iterations_end_overlaps_its_weight_sync(
    tmp_path: Path,
) -> None:
    """The six-turn tasks' tool calls take a second, so their episodes are withdrawn
    mid-call: the iteration trains, syncs the weights and ends while such a call runs
    (it does not wait for it), and the next iteration takes the episode on once the
    call is over (parked, or finished if the call ended it); every iteration trains
    its 16 samples and every environment is closed once."""
    pytest.importorskip("torch")
    from dynarl.api.facade import DynaRL

    cfg = apply_overrides(
        DynaRLConfig(),
        [
            *EPISODES,
            "run.checkpoint_every=0",  # an iteration's end is its stats
            f"run.run_dir={tmp_path / 'run'}",
        ],
    )
    Relay.made = Relay.closed = 0
    Relay.slow_s, Relay.steps = 1.0, []
    ends: list[float] = []
    try:
        async with DynaRL(cfg, environment=RELAY) as rl:
            async for stats in rl.iterations():
                ends.append(time.monotonic())
                assert stats.num_samples == NUM_PROMPTS * GROUP
                assert stats.episodes["aborted"] == 0
            assert rl.controller is not None
            assert rl.controller.statistics().events_rejected == {}
    finally:
        Relay.slow_s = 0.05
    overlapped = [(start, end) for start, end in Relay.steps if any(start < t < end for t in ends)]
    assert overlapped, "no tool call outlived its iteration (did the iteration wait?)"
    assert Relay.closed == Relay.made
