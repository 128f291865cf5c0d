"""Partial rollouts in the simulator: each iteration trains exactly ``num_prompts``
groups, the unfinished ones carry over with every token they generated, and no group
is carried more often than ``algorithm.max_staleness`` allows."""

from pathlib import Path

import pytest
from test_sim_world import MODES, run, small

from dynarl.cli import main
from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.rl.config import AlgorithmConfig
from dynarl.sim.partial import PartialRollouts
from dynarl.sim.progress import SeqProgress


def _group(name: str, size: int = 2, tokens: int = 100) -> list[Request]:
    return [
        Request(
            id=ItemId(f"{name}-s{k}"),
            group=GroupId(name),
            prompt_tokens=10,
            output_tokens=(tokens,),
        )
        for k in range(size)
    ]


def _finish(book: PartialRollouts, seqs: list[SeqProgress], group: str) -> list[ItemId]:
    """Finish every sample of ``group``; the ids the book sends downstream."""
    done = [s for s in seqs if s.request.group == group]
    for s in done:
        s.done = s.request.output_tokens[0]
    return [s.request.id for s in book.finished(done)]


def test_a_group_is_admitted_when_whole_until_the_iteration_has_its_groups() -> None:
    book = PartialRollouts(AlgorithmConfig(num_prompts=2, group_size=2, over_sample_prompts=2))
    assert book.fresh_groups_needed() == 4
    seqs, ready = book.begin([r for g in "abcd" for r in _group(g)])
    assert len(seqs) == 8 and ready == []
    # A finished sample waits for its group: nothing is scored that may not be trained.
    assert [s.request.id for s in book.finished([seqs[0]])] == []
    assert _finish(book, seqs, "b") == ["b-s0", "b-s1"]
    assert not book.rollout_over
    assert _finish(book, seqs, "c") == ["c-s0", "c-s1"]
    assert book.rollout_over and book.num_carried_groups == 2
    # "a" half done and "d" untouched carry over; "b" and "c" are trained.
    seqs[1].done = 40  # a-s1 got 40 tokens in before the rollout ended
    trained, older, most = book.end()
    assert [r.group for r in trained] == ["b", "b", "c", "c"]
    assert (older, most) == (0, 0)
    assert book.fresh_groups_needed() == 2


def test_a_group_carried_to_the_bound_is_trained_first_and_holds_the_rollout() -> None:
    book = PartialRollouts(AlgorithmConfig(num_prompts=2, group_size=2, over_sample_prompts=1))
    seqs, _ = book.begin([r for g in "abc" for r in _group(g)])
    _finish(book, seqs, "b")
    _finish(book, seqs, "c")
    book.end()  # "a" carried once: due next time (max_staleness 1)
    seqs, _ = book.begin(_group("d"))
    assert [s.request.group for s in seqs] == ["a", "a", "d", "d"]  # carried first
    assert _finish(book, seqs, "d") == ["d-s0", "d-s1"]
    assert not book.rollout_over  # "a" is due: the rollout waits for it
    assert _finish(book, seqs, "a") == ["a-s0", "a-s1"]
    assert book.rollout_over
    trained, older, most = book.end()
    assert sorted({r.group for r in trained}) == ["a", "d"] and most == 1
    assert older == 0  # "a" had generated nothing before this iteration


def test_a_group_whole_beyond_the_quota_is_trained_next_iteration() -> None:
    book = PartialRollouts(
        AlgorithmConfig(num_prompts=2, group_size=2, over_sample_prompts=2, max_staleness=2)
    )
    seqs, _ = book.begin([r for g in "abcd" for r in _group(g)])
    _finish(book, seqs, "a")
    seqs[2].done = 30  # b-s0: 30 tokens in, then withdrawn
    book.end()  # one admitted: not over; the world ends iterations only once over
    seqs, ready = book.begin(_group("e"))
    # "b", "c", "d" carried once, below the bound of 2: "e" and two of them compete.
    assert {s.request.group for s in seqs} == {"b", "c", "d", "e"} and ready == []
    _finish(book, seqs, "c")
    _finish(book, seqs, "e")
    assert book.rollout_over
    assert _finish(book, seqs, "d") == []  # whole beyond the quota
    trained, _, _ = book.end()
    assert {r.group for r in trained} == {"c", "e"}
    seqs, ready = book.begin(_group("f"))
    # "d" is whole: admitted at once (carried ones first), sent downstream now.
    assert [s.request.id for s in ready] == ["d-s0", "d-s1"]
    assert {s.request.group for s in seqs} == {"b", "f"}


@pytest.mark.parametrize("mode", MODES)
def test_each_iteration_trains_its_groups_and_carries_the_rest(mode: str) -> None:
    over = 8
    cfg = small(
        16,
        f"scheduler.mode={mode}",
        f"algorithm.over_sample_prompts={over}",
        "run.num_iterations=4",
    )
    result, _ = run(cfg)
    assert result.events_rejected == {}
    # Every token generated once: trained responses whole, carried ones as far as
    # they got (aborted at each rollout's end, resumed in the next iteration).
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    for r in result.iterations:
        assert r.num_sequences == 32 * 8
        assert r.carried_groups == over
        assert r.max_times_carried <= 1
    assert any(r.older_tokens > 0 for r in result.iterations[1:])
    assert result.iterations[0].older_tokens == 0


def test_agentic_sessions_carry_over_mid_episode() -> None:
    cfg = small(
        16,
        "sim.workload=agentic",
        "sim.request_order=priority",
        "algorithm.over_sample_prompts=8",
        "algorithm.max_staleness=2",
        "run.num_iterations=3",
    )
    result, _ = run(cfg)
    assert result.events_rejected == {}
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert all(r.num_sequences == 256 and r.max_times_carried <= 2 for r in result.iterations)
    assert sum(r.older_tokens for r in result.iterations) > 0


def test_partial_rollouts_shorten_the_iteration_of_a_long_tailed_batch() -> None:
    """The point of it: the rollout ends when the groups it trains are whole instead
    of waiting for the longest responses (the same requests, the same seed)."""
    on_policy, _ = run(small(16, "run.num_iterations=3", "sim.warmup_iterations=2"))
    partial, _ = run(
        small(
            16,
            "run.num_iterations=3",
            "sim.warmup_iterations=2",
            "algorithm.over_sample_prompts=8",
        )
    )
    assert partial.mean_iteration_s < on_policy.mean_iteration_s


def test_dynarl_sim_reports_what_partial_rollouts_carried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "sim",
            "--out",
            str(tmp_path),
            "--set",
            "rollout.max_new_tokens=2048",
            "--set",
            "run.num_iterations=3",
            "--set",
            "algorithm.over_sample_prompts=4",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "partial rollouts: 4 groups carried on per iteration" in out
    assert "of the trained response tokens from older weights" in out
