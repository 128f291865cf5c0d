"""Partial rollouts in a real run (``algorithm.over_sample_prompts``): every iteration
trains exactly ``num_prompts`` groups, the requests it cut resume in the next one with
every token they had (the old weights' tokens, then the new weights'), nothing trained
is staler than ``max_staleness``, the iteration's stats say so, and a checkpoint keeps
what is carried, so a resumed run resumes it. Multi-turn environments are refused."""

from pathlib import Path

import msgspec
import pytest

from dynarl.api.assembly import environment_of
from dynarl.api.checkpoint import RunState, checkpoints, write_state
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.core.errors import ConfigError
from dynarl.core.ids import GroupId
from dynarl.envs.prompts import Prompt
from dynarl.obs.metrics import IterationStats, PartialRolloutStats, flat_record
from dynarl.rl.carry import CarriedGroup, CarryState, FinishedSample, PartialSample
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


@pytest.mark.parametrize("where", ["config", "code"])
def test_a_multi_turn_environment_is_refused_naming_the_field_and_the_fix(where: str) -> None:
    from dynarl.envs.builtin import builtin_environment

    named = ["env.name=lookup"] if where == "config" else []
    cfg = apply_overrides(
        DynaRLConfig(), ["algorithm.over_sample_prompts=2", "model.tokenizer=chat", *named]
    )
    given = None if where == "config" else builtin_environment("lookup", seed=0)
    with pytest.raises(ConfigError, match=r"set algorithm\.over_sample_prompts=0") as error:
        environment_of(cfg, given)
    assert error.value.field == "algorithm.over_sample_prompts"
    assert "multi-turn" in str(error.value)


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
    assert stats.iteration == 3 and stats.partial_rollout is not None
    assert stats.partial_rollout.num_carried_in == carried.num_samples
    assert resumed_with_tokens > 0  # some requests really were cut mid-response
