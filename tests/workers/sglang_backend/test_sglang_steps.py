"""An SGLang engine's step counts: SGLang's Prometheus counters parsed (both releases'
forward-pass categories, one TP rank of several, the idle gaps added; a server with
data-parallel ranks refused), the engine's tally over reads (decode tokens from its
streams, a moved request's share of the prefill seconds, a restarted server, a server
without the device timer, counts that never go back), and the adapter against a fake
server that serves ``/metrics``: its decode steps, tokens and seconds match the server
engine's own, and where the server serves none the engine reports none."""

import pytest

from dynarl.testing.fake_sglang import FakeSGLang
from dynarl.testing.sinks import RecordingSink
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.sglang.step_metrics import (
    TIMER_CHECK_STEPS,
    ServerSteps,
    StepTally,
    parse_server_steps,
)

from .conftest import MODEL, running, until

LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0"'


def exposition(rows: list[tuple[str, str, float]], *, families: tuple[str, ...] = ()) -> str:
    """Prometheus text of counters ``(name, labels, value)``, each family declared."""
    names = dict.fromkeys([*families, *(name for name, _, _ in rows)])
    lines = []
    for name in names:
        lines += [f"# HELP {name} x", f"# TYPE {name} counter"]
        lines += [f"{n}{{{LABELS},{labels}}} {v}" for n, labels, v in rows if n == name]
    return "\n".join(lines) + "\n"


PASSES, EXEC, WAIT = (
    "sglang:cuda_graph_passes_total",
    "sglang:gpu_execution_seconds_total",
    "sglang:gpu_overlap_wait_seconds_total",
)


@pytest.mark.parametrize("prefix", ["forward_", ""])
def test_the_counters_of_either_releases_categories_are_read(prefix: str) -> None:
    text = exposition(
        [
            (PASSES, 'mode="decode_cuda_graph",tp_rank="0"', 300.0),
            (PASSES, 'mode="decode_none",tp_rank="0"', 11.0),
            (EXEC, f'category="{prefix}decode",tp_rank="0"', 6.0),
            (EXEC, f'category="{prefix}extend",tp_rank="0"', 1.5),
            (EXEC, f'category="{prefix}idle",tp_rank="0"', 9.0),
            (WAIT, f'category="{prefix}decode",tp_rank="0"', 0.25),
            (WAIT, f'category="{prefix}extend",tp_rank="0"', 0.125),
        ]
    )
    histogram = [  # the rest of a server's page, left out
        "# HELP sglang:time_to_first_token_seconds x",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        f'sglang:time_to_first_token_seconds_bucket{{le="0.1",{LABELS},tp_rank="0"}} 3.0',
        f'sglang:time_to_first_token_seconds_sum{{{LABELS},tp_rank="0"}} 0.2',
        f'sglang:time_to_first_token_seconds_count{{{LABELS},tp_rank="0"}} 3.0',
    ]
    page = "\n".join(histogram) + "\n" + text
    assert parse_server_steps(text) == parse_server_steps(page) == ServerSteps(311, 6.25, 1.625)


def test_of_every_ranks_counters_the_first_ranks_are_read() -> None:
    text = exposition(
        [
            (PASSES, 'mode="decode_none",tp_rank="1"', 50.0),
            (PASSES, 'mode="decode_none",tp_rank="0"', 40.0),
            (EXEC, 'category="decode",tp_rank="10"', 9.0),
            (EXEC, 'category="decode",tp_rank="0"', 2.0),
            (EXEC, 'category="extend",tp_rank="1"', 9.0),
        ]
    )
    assert parse_server_steps(text) == ServerSteps(40, 2.0, 0.0)


def test_a_server_with_data_parallel_ranks_is_not_read_as_one_engine() -> None:
    text = exposition(
        [
            (PASSES, 'mode="decode_none",tp_rank="0",dp_rank="0"', 50.0),
            (PASSES, 'mode="decode_none",tp_rank="0",dp_rank="1"', 40.0),
            (EXEC, 'category="decode",tp_rank="0",dp_rank="0"', 2.0),
        ]
    )
    assert parse_server_steps(text) is None
    assert parse_server_steps(text.replace('dp_rank="1"', 'dp_rank="0"')) is not None


def test_counters_not_yet_incremented_read_zero_and_missing_ones_none() -> None:
    assert parse_server_steps(exposition([], families=(PASSES, EXEC))) == ServerSteps(0, 0.0, 0.0)
    assert parse_server_steps(exposition([], families=(PASSES,))) is None
    assert parse_server_steps("") is None
    with pytest.raises(ValueError):
        parse_server_steps(f"{PASSES}{{mode=decode_none 12\n")


def test_the_tally_counts_from_its_first_read_and_shares_prefills_by_computed_tokens() -> None:
    tally = StepTally("slot-0")
    tally.generated(5, first=True)  # before the first read: not counted
    tally.read(ServerSteps(100, 2.0, 1.0))
    assert tally.counts.decode_steps == 0
    # a fresh request: 30 tokens computed; a moved one: 90 (its cached prefix left out)
    tally.prefilled(30, resumed=False)
    tally.prefilled(90, resumed=True)
    tally.generated(1, first=True)
    tally.generated(1, first=True)
    for _ in range(20):
        tally.generated(2, first=False)
    tally.read(ServerSteps(120, 2.5, 1.4))
    c = tally.counts
    assert (c.decode_steps, c.decode_tokens) == (20, 40)
    assert c.decode_s == pytest.approx(0.5)
    assert c.prefill_s == pytest.approx(0.4)
    assert c.resume_prefill_s == pytest.approx(0.4 * 90 / 120)
    # a restarted server's counters go back: nothing counted, then on from them
    tally.generated(3, first=False)
    tally.read(ServerSteps(2, 0.01, 0.0))
    assert tally.counts == c
    tally.generated(4, first=False)
    tally.read(ServerSteps(6, 0.05, 0.0))
    assert tally.counts.decode_steps == 24 and tally.counts.decode_tokens == 44


def test_a_server_without_the_device_timer_stops_the_tally() -> None:
    tally = StepTally("slot-0")
    tally.read(ServerSteps(0, 0.0, 0.0))
    tally.read(ServerSteps(TIMER_CHECK_STEPS - 1, 0.0, 0.0))
    assert tally.counting
    tally.read(ServerSteps(TIMER_CHECK_STEPS, 0.0, 0.0))
    assert not tally.counting and tally.counts.decode_steps == 0


def test_the_counts_are_published_once_timed_and_never_go_back() -> None:
    # the control plane takes differences of them: a count that fell would read negative
    tally = StepTally("slot-0")
    tally.read(ServerSteps(0, 0.0, 0.0))
    tally.generated(30, first=False)
    tally.read(ServerSteps(30, 0.0, 0.0))  # steps without seconds (yet): not published
    assert tally.counts.decode_steps == 0 and tally.counting
    tally.read(ServerSteps(40, 0.1, 0.0))
    published = tally.counts
    assert published.decode_steps == 40 and published.decode_tokens == 30
    tally.stop("a read failed")  # after that, only a missed read
    assert tally.counting and tally.counts == published


def requests(n: int, *, max_new_tokens: int, output: int = 0) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"r{i}-{output}",
            prompt_ids=(3 + i, 17, 29, 41, 5, 6, 7, 8),
            output_ids=tuple(range(10, 10 + output)),
            output_logprobs=(-1.0,) * output,
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, seed=i
            ),
        )
        for i in range(n)
    ]


async def test_the_engine_reports_the_servers_decode_steps_with_its_own_tokens() -> None:
    with FakeSGLang(MODEL, enable_metrics=True, metrics_device_timer=True) as fake:
        async with running(fake, stats_interval_s=0.05) as engine:
            await until(lambda: engine._steps._last is not None)  # counting from here
            sink = RecordingSink(raise_on_fail=True)
            await engine.submit(requests(3, max_new_tokens=40), sink)
            await engine.submit(requests(2, max_new_tokens=40, output=20), sink)
            await sink.wait_for(lambda: len(sink.completions) == 5)
            served = fake.engine.stats()
            # the reads after the last step: the counts are the server's, whole
            await until(lambda: engine.load().decode_steps == served.decode_steps, timeout_s=5)
            load = engine.load()
    # 5 requests: 3 x 40 + 2 x 20 tokens, each stream's first from its prefill
    assert load.decode_tokens == served.decode_tokens == 3 * 39 + 2 * 19
    assert load.decode_s == pytest.approx(served.decode_s)
    assert load.prefill_s == pytest.approx(served.prefill_s)
    assert 0 < load.resume_prefill_s < load.prefill_s
    assert load.prefill_steps == 0  # SGLang does not count its prefill passes


@pytest.mark.parametrize("metrics", [False, True])
async def test_a_server_that_counts_no_steps_leaves_the_engine_reporting_none(
    metrics: bool,
) -> None:
    # metrics=True: /metrics served, but without the device timer's seconds
    with FakeSGLang(MODEL, enable_metrics=metrics, metrics_device_timer=False) as fake:
        async with running(fake, stats_interval_s=0.05) as engine:
            sink = RecordingSink(raise_on_fail=True)
            await engine.submit(requests(2, max_new_tokens=TIMER_CHECK_STEPS + 10), sink)
            await sink.wait_for(lambda: len(sink.completions) == 2)
            await until(lambda: not engine._steps.counting, timeout_s=5)
            load = engine.load()
    assert (load.decode_steps, load.decode_tokens, load.decode_s) == (0, 0, 0.0)
