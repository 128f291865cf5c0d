"""The run directory without workers: which checkpoint a resume picks, what it keeps
of the metrics and timeline written after it, the flat metrics records, and a resume
that cannot work failing before any process starts."""

from pathlib import Path

import msgspec
import pytest

from dynarl.api.checkpoint import (
    ResumeError,
    RunState,
    latest_checkpoint,
    trainer_path,
    write_state,
)
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, dump_config
from dynarl.api.run_dir import RunDirectory
from dynarl.control.pipeline import build_hypergraph
from dynarl.core.ids import DeviceId
from dynarl.obs.metrics import (
    IterationStats,
    MetricsWriter,
    MigrationRecord,
    flat_record,
    read_metrics,
)
from dynarl.obs.timeline import Interval, Mark, TimelineRecorder, read_timeline, write_lines


def stats(iteration: int, **extra: object) -> IterationStats:
    base = dict(
        iteration=iteration,
        mean_reward=0.1 * iteration,
        solved_fraction=0.0,
        num_samples=4,
        gen_tokens=40,
        mean_response_tokens=10.0,
        tokens_per_s=100.0,
        loss=0.5,
        grad_norm=1.0,
        weight_version=iteration + 1,
        stage_s={"rollout": 1.0, "train": 0.5},
        elapsed_s=2.0,
    )
    return msgspec.convert({**base, **extra}, IterationStats)


def checkpoint(run_dir: Path, done: int, *, seed: int = 0, timeline_s: float = 0.0) -> None:
    path = trainer_path(run_dir, done)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"trainer state")
    write_state(
        run_dir,
        RunState(
            num_iterations=done,
            weight_version=done,
            seed=seed,
            sampler={"epoch": 0, "position": 8 * done, "seed": seed},
            timeline_s=timeline_s,
        ),
    )


def test_the_latest_complete_checkpoint_is_chosen(tmp_path: Path) -> None:
    checkpoint(tmp_path, 2)
    checkpoint(tmp_path, 4)
    trainer_path(tmp_path, 6).write_bytes(b"torn: the run died before its state was written")
    found = latest_checkpoint(tmp_path)
    assert found.trainer_path == trainer_path(tmp_path, 4)
    assert found.state.num_iterations == 4 and found.state.sampler["position"] == 32
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_no_checkpoint_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match=r"holds no complete checkpoint.*start a new run"):
        latest_checkpoint(tmp_path)


def test_resume_drops_what_was_written_after_the_checkpoint(tmp_path: Path) -> None:
    files = RunDirectory(tmp_path)
    with MetricsWriter(files.metrics_path) as writer:
        for i in range(3):  # iteration 2 finished, but the run died before its checkpoint
            writer.write(stats(i))
    write_lines(
        files.timeline_path,
        [
            Interval(run="m", device=0, component="actor", start_s=0.0, end_s=9.0),
            Mark(run="m", what="iteration_end", iteration=1, time_s=5.0),
            Mark(run="m", what="iteration_end", iteration=2, time_s=8.0),
        ],
    )
    checkpoint(tmp_path, 2, timeline_s=6.0)

    resumed = files.resume_point(DynaRLConfig())
    assert [s.iteration for s in resumed.history] == [0, 1]
    assert read_metrics(files.metrics_path) == resumed.history
    assert resumed.timeline == [
        Interval(run="m", device=0, component="actor", start_s=0.0, end_s=6.0),
        Mark(run="m", what="iteration_end", iteration=1, time_s=5.0),
    ]
    with MetricsWriter(files.metrics_path, append=True) as writer:
        writer.write(stats(2))
    assert [s.iteration for s in read_metrics(files.metrics_path)] == [0, 1, 2]


def test_resume_refuses_another_seed_and_missing_metrics(tmp_path: Path) -> None:
    files = RunDirectory(tmp_path)
    checkpoint(tmp_path, 2, seed=0)
    with pytest.raises(ResumeError, match=r"run.seed=0, not 3; resume with the run's own seed"):
        files.resume_point(apply_overrides(DynaRLConfig(), ["run.seed=3"]))
    with pytest.raises(ResumeError, match=r"metrics\.jsonl holds iterations"):
        files.resume_point(DynaRLConfig())


def test_resume_loads_the_saved_config_with_overrides(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match=r"config\.yaml does not exist"):
        RunDirectory(tmp_path).load_config()
    dump_config(apply_overrides(DynaRLConfig(), ["run.num_iterations=3"]), tmp_path / "config.yaml")
    cfg = RunDirectory(tmp_path).load_config(["run.num_iterations=7"])
    assert cfg.run.num_iterations == 7


async def test_resuming_a_directory_without_a_checkpoint_fails_before_starting(
    tmp_path: Path,
) -> None:
    from dynarl.api.facade import DynaRL

    dump_config(DynaRLConfig(), tmp_path / "config.yaml")
    rl = DynaRL.resume(tmp_path)
    assert rl.run_dir == tmp_path
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        async with rl:
            pass
    assert not (tmp_path / "metrics.jsonl").exists()


def test_flat_records_take_nested_stats_apart() -> None:
    record = flat_record(
        stats(
            3,
            device_s={"rollout": 4.0, "actor": 2.0},
            allocation={"rollout": 2, "actor": 1},
            migrations=[
                MigrationRecord(
                    kind="workload", src="rollout", dst=None, num_devices=1, duration_s=0.5, ok=True
                )
            ],
        )
    )
    assert record["stage_s.rollout"] == 1.0 and record["device_s.actor"] == 2.0
    assert record["allocation.rollout"] == 2
    assert record["num_migrations"] == 1 and record["migration_s"] == 0.5
    assert all(not isinstance(v, dict | list) for v in record.values())


def test_the_timeline_so_far_includes_open_intervals_and_continues_an_offset() -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        ["cluster.num_devices=2", "rollout.initial_devices=1", "inference.initial_devices=0"],
    )
    graph, _ = build_hypergraph(cfg.pipeline_layout(), now_s=100.0)
    recorder = TimelineRecorder(graph, run="m", offset_s=20.0)
    assert list(recorder.lines()) == []
    lines = list(recorder.lines(now_s=103.0))
    assert {(iv.device, iv.start_s, iv.end_s) for iv in lines if isinstance(iv, Interval)} == {
        (0, 20.0, 23.0),
        (1, 20.0, 23.0),
    }


def test_timeline_lines_round_trip(tmp_path: Path) -> None:
    lines = [
        Interval(run="m", device=1, component="rollout", start_s=0.0, end_s=2.0),
        Mark(run="m", what="iteration_start", iteration=0, time_s=0.5),
    ]
    write_lines(tmp_path / "t.jsonl", lines)
    assert read_timeline(tmp_path / "t.jsonl") == lines


def test_a_device_that_arrives_and_leaves_at_one_instant_keeps_one_interval() -> None:
    # A device that finished one move and started the next at the same instant held
    # its new component for no time: its "migrating" interval goes on, not split in two.
    cfg = apply_overrides(
        DynaRLConfig(),
        ["cluster.num_devices=2", "rollout.initial_devices=1", "inference.initial_devices=0"],
    )
    graph, _ = build_hypergraph(cfg.pipeline_layout(), now_s=0.0)
    script = {0: ["migrating", "actor", "migrating", "rollout"], 1: ["actor"] * 4}

    class Scripted(TimelineRecorder):
        step = 0

        def _label(self, d: DeviceId) -> str:
            return script[d][self.step - 1] if self.step else "rollout"

    recorder = Scripted(graph, run="m")
    for step, t in enumerate((1.0, 2.0, 2.0, 5.0), start=1):
        recorder.step = step
        recorder._refresh(t)
    recorder.close(6.0)
    spans = sorted(
        (iv.start_s, iv.end_s, iv.component) for iv in recorder.intervals if iv.device == 0
    )
    assert spans == [(0.0, 1.0, "rollout"), (1.0, 5.0, "migrating"), (5.0, 6.0, "rollout")]
    assert sum(iv.end_s - iv.start_s for iv in recorder.intervals) == pytest.approx(12.0)


def test_a_run_starts_its_predictor_from_the_profile_it_names_or_its_own(tmp_path: Path) -> None:
    from dynarl.api.assembly import predictor_profile
    from dynarl.control.predictor import Predictor
    from dynarl.control.predictor_profile import Profile, ProfileRow
    from dynarl.core.errors import ConfigError
    from dynarl.core.ids import ComponentId

    spec = build_hypergraph(DynaRLConfig().pipeline_layout())[0].spec
    rollout = ComponentId("rollout")
    learnt = Predictor.for_pipeline(spec)
    for load in (1, 4, 16, 64):
        learnt.observe(rollout, 2, load, 100.0 * load / (1 + load / 16))
    earlier = RunDirectory(tmp_path / "earlier")
    earlier.path.mkdir()
    earlier.write_predictor(learnt.to_profile())

    def named(path: object) -> DynaRLConfig:
        return apply_overrides(DynaRLConfig(), [f"scheduler.predictor_profile={path}"])

    # Named: that profile; unnamed: nothing, or a resumed run's own predictor.json.
    profile = predictor_profile(named(earlier.predictor_path), spec)
    assert profile is not None and len(profile.rows) == 4
    assert predictor_profile(DynaRLConfig(), spec) is None
    assert predictor_profile(DynaRLConfig(), spec, tmp_path / "fresh") is None
    own = predictor_profile(DynaRLConfig(), spec, earlier.path)
    assert own == profile
    seeded = Predictor.for_pipeline(spec, profile=own)
    assert seeded.predict(rollout, 2, 8).num_observations == 4
    damaged = RunDirectory(tmp_path / "damaged")
    damaged.path.mkdir()
    damaged.predictor_path.write_text('{"rows": [')  # not needed to resume: skipped
    assert predictor_profile(DynaRLConfig(), spec, damaged.path) is None

    # What cannot seed it is refused, naming the setting.
    with pytest.raises(ConfigError, match="does not exist") as missing:
        predictor_profile(named(tmp_path / "nowhere.json"), spec)
    assert missing.value.field == "scheduler.predictor_profile"
    (tmp_path / "bad.json").write_text('{"rows": 3}')
    with pytest.raises(ConfigError, match="is not a predictor profile"):
        predictor_profile(named(tmp_path / "bad.json"), spec)
    other = ProfileRow(component=ComponentId("critic"), devices=1, load=1, throughput=1.0)
    Profile(rows=(other,)).save(tmp_path / "other.json")
    with pytest.raises(ConfigError, match=r"measures \[.critic.\]"):
        predictor_profile(named(tmp_path / "other.json"), spec)


def test_the_simulator_refuses_a_real_run_s_predictor_profile() -> None:
    from dynarl.core.errors import ConfigError
    from dynarl.sim.config import simulated_run

    with pytest.raises(ConfigError, match="profiling run on the simulated hardware") as err:
        simulated_run(DynaRLConfig(), ["scheduler.predictor_profile=runs/x/predictor.json"])
    assert err.value.field == "scheduler.predictor_profile"


async def test_a_predictor_profile_that_cannot_seed_the_run_fails_before_it_writes(
    tmp_path: Path,
) -> None:
    from dynarl.api.facade import DynaRL
    from dynarl.core.errors import ConfigError

    cfg = apply_overrides(
        DynaRLConfig(),
        [f"run.run_dir={tmp_path / 'run'}", f"scheduler.predictor_profile={tmp_path / 'x'}"],
    )
    with pytest.raises(ConfigError, match="does not exist"):
        async with DynaRL(cfg):
            pass
    assert not (tmp_path / "run").exists()
