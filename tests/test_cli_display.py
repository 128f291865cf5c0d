"""The progress display of `dynarl run`: plain lines off a terminal, a live panel with
the stage's progress, reward, tokens/s and devices on one."""

import io

import msgspec
import pytest

from dynarl.cli_display import RunDisplay
from dynarl.obs.metrics import IterationStats, PartialRolloutStats
from dynarl.rl.progress import Progress

rich_console = pytest.importorskip("rich.console")


def stats(iteration: int) -> IterationStats:
    return msgspec.convert(
        {
            "iteration": iteration,
            "mean_reward": 0.375,
            "solved_fraction": 0.25,
            "num_samples": 32,
            "gen_tokens": 640,
            "mean_response_tokens": 20.0,
            "tokens_per_s": 321.0,
            "loss": 0.5,
            "grad_norm": 1.0,
            "weight_version": iteration + 1,
            "stage_s": {"rollout": 1.0},
            "elapsed_s": 2.0,
            "allocation": {"rollout": 1, "actor": 1},
        },
        IterationStats,
    )


def test_off_a_terminal_it_prints_one_plain_line_per_iteration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with RunDisplay(live=False, num_iterations=4) as display:
        display.progress(Progress(iteration=0, stage="rollout", done=3, total=32))
        display.iteration(stats(0))
        display.progress(Progress(iteration=1, stage="train", done=1, total=2))
        display.iteration(stats(1))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("iter   1  reward 0.375") and "[rollout=1 actor=1]" in lines[1]
    assert "\x1b" not in "".join(lines)  # no terminal control codes


def test_the_live_panel_shows_progress_reward_and_devices() -> None:
    out = io.StringIO()
    console = rich_console.Console(file=out, force_terminal=True, width=120)
    with RunDisplay(live=True, num_iterations=4, console=console) as display:
        display.allocation = lambda: {"rollout": 1, "inference": 0, "actor": 1}
        display.iteration(stats(0))
        display.progress(Progress(iteration=1, stage="rollout", done=12, total=32))
    panel = out.getvalue()
    assert "iter   0  reward 0.375" in panel  # the finished iteration's line stays
    assert "2/4" in panel and "12/32 responses" in panel
    assert "0.375" in panel and "321" in panel
    assert "rollout 1  inference 0  actor 1" in panel


def test_partial_rollouts_show_what_was_carried_and_how_stale_training_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    partial = msgspec.structs.replace(
        stats(1),
        partial_rollout=PartialRolloutStats(
            num_carried_in=8,
            num_resumed=3,
            num_carried_out=8,
            max_times_carried=1,
            max_weight_lag=1,
            stale_token_fraction=0.25,
        ),
    )
    with RunDisplay(live=False, num_iterations=4) as display:
        display.iteration(stats(0))
        display.iteration(partial)
    on_policy, carried = capsys.readouterr().out.splitlines()
    assert "carried" not in on_policy and "stale" not in on_policy
    assert "carried in 8 (resumed 3) out 8  lag 1  stale 25%" in carried
    out = io.StringIO()
    console = rich_console.Console(file=out, force_terminal=True, width=120)
    with RunDisplay(live=True, num_iterations=4, console=console) as display:
        display.iteration(partial)
    assert "partial" in out.getvalue() and "lag 1" in out.getvalue()
