"""The modelled rollout engine: its step-time anchor, its analytic time against a
token-by-token reference, conservation across migrations, preemption, prefix reuse."""

import math
import random
import statistics

import pytest

from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.sim import H100, EngineConfig, Job, JobDone, SimEngine, SimError, model

SMALL = model("R1-Distill-Qwen-1.5B")


def _config(**overrides: object) -> EngineConfig:
    return EngineConfig(gpu=H100, model=SMALL, **overrides)  # type: ignore[arg-type]


def _job(name: str, context: int, output: int, *, tool: bool = False) -> Job:
    return Job(
        id=ItemId(name),
        group=GroupId("g"),
        context_tokens=context,
        output_tokens=output,
        tool_call_after=tool,
    )


def _engine(config: EngineConfig, name: str = "e0") -> SimEngine:
    return SimEngine(config, instance=InstanceId(name))


def test_decode_step_is_anchored_to_the_reference() -> None:
    # 1.5B at batch 128 and mean context 10K on an H100: ≈12 ms per step
    step = _config().decode_step_s(128, 128 * 10_000)
    assert step == pytest.approx(0.012, rel=0.3)
    # the tail at batch 8 decodes ≈1–2K tokens/s
    assert 1000 < 8 / _config().decode_step_s(8, 8 * 20_000) < 2500


def _one_prefill_reference(config: EngineConfig, jobs: list[Job]) -> dict[ItemId, float]:
    """Token by token: one prefill of every job, which samples each one's first token
    (a one-token job ends there), then one token per running job per step."""
    a, b = config.step_coefficients()
    c = config.step_per_request_s
    t = config.prefill_overhead_s + sum(config.prefill_s(j.context_tokens) for j in jobs)
    ctx = {j.id: j.context_tokens + 1 for j in jobs}
    left = {j.id: j.output_tokens - 1 for j in jobs}
    expected: dict[ItemId, float] = {i: t for i, n in left.items() if not n}
    left = {i: n for i, n in left.items() if n}
    while left:
        t += a + c * len(left) + b * sum(ctx[i] for i in left)
        for i in list(left):
            ctx[i] += 1
            left[i] -= 1
            if not left[i]:
                expected[i] = t
                del left[i]
    return expected


def test_analytic_time_matches_token_by_token_reference() -> None:
    config = _config()
    rng = random.Random(3)
    jobs = [_job(f"r{i}", rng.randint(16, 1024), rng.randint(1, 3000)) for i in range(40)]
    engine = _engine(config)
    engine.submit(jobs)
    done = engine.advance_to(1e9)

    expected = _one_prefill_reference(config, jobs)
    assert {d.id: d.time_s for d in done} == pytest.approx(expected, rel=1e-9)
    assert [d.time_s for d in done] == sorted(d.time_s for d in done)
    assert engine.totals().generated_tokens == sum(j.output_tokens for j in jobs)


def test_ticking_and_looking_do_not_change_the_outcome() -> None:
    jobs = [_job(f"r{i}", 100 + 7 * i, 50 + 13 * i) for i in range(30)]
    one_jump, ticked = _engine(_config()), _engine(_config())
    one_jump.submit(jobs)
    ticked.submit(jobs)
    expected = one_jump.advance_to(100.0)
    got: list[JobDone] = []
    t = 0.0
    while t < 100.0:
        t += 0.0137
        got += ticked.advance_to(t)
        stats = ticked.stats()
        assert 0.0 <= stats.kv_usage <= 1.0
    assert [(d.id, d.generated_tokens) for d in got] == [
        (d.id, d.generated_tokens) for d in expected
    ]
    assert [d.time_s for d in got] == pytest.approx([d.time_s for d in expected], rel=1e-9)


def test_stats_report_running_queued_and_usage() -> None:
    config = _config(max_running_requests=4, kv_capacity_tokens=100_000)
    engine = _engine(config)
    assert engine.next_event_time() == math.inf
    engine.submit([_job(f"r{i}", 1000, 5000) for i in range(6)])
    engine.advance_to(1.0)
    stats = engine.stats()
    assert (stats.num_running, stats.num_queued) == (4, 2)
    a, b = config.step_coefficients()
    held = stats.kv_usage * 100_000
    assert 4000 < held < 4000 + 4 * 5000
    # Throughput since the last report (here: since start): every token generated in
    # the first second (the prompts' 4 x 1000 were prefilled, not generated), the
    # step in progress pro rata.
    assert held - 4000 <= stats.gen_tokens_per_s <= held - 4000 + 4
    assert stats.instance == "e0"
    assert stats.time_s == 1.0
    # A second report at the same instant has no window: the current decode rate.
    assert engine.stats().gen_tokens_per_s == pytest.approx(4 / (a + b * held))


def test_reported_throughput_integrates_to_the_tokens_generated() -> None:
    """Summing each report's rate times the time since the previous report gives the
    tokens generated, including the stretch before an engine falls idle (a rate of
    the current batch would count that stretch at 0)."""
    config = _config(max_running_requests=4, kv_capacity_tokens=100_000)
    engine = _engine(config)
    engine.submit([_job(f"r{i}", 100, 50 * (i + 1)) for i in range(6)])
    integral, last = 0.0, 0.0
    t = 0.0
    while engine.next_event_time() < math.inf or t == 0.0:
        t = min(engine.next_event_time(), t + 0.37)
        engine.advance_to(t)
        stats = engine.stats()
        integral += stats.gen_tokens_per_s * (t - last)
        last = t
    assert stats.num_running == 0
    assert integral == pytest.approx(engine.totals().generated_tokens, rel=1e-9)


def test_step_counts_keep_pace_with_the_tokens_reported() -> None:
    """A report counts the decode steps done by its time and their seconds, as a real
    engine counts each step as it ends: between two reports, the tokens generated over
    the steps are the batch (the controller reads its decode rate from them), however
    long the engine has gone without an event of its own."""
    config = _config(max_running_requests=8, kv_capacity_tokens=1_000_000)
    engine = _engine(config)
    engine.submit([_job(f"r{i}", 1000, 4000) for i in range(8)])
    engine.advance_to(1.0)
    before, generated = engine.stats(), 0.0
    for k in range(1, 11):  # no event falls in these 5 s: one segment of steps
        engine.advance_to(1.0 + 0.5 * k)
        stats = engine.stats()
        generated += stats.gen_tokens_per_s * 0.5
    steps = stats.decode_steps - before.decode_steps
    assert steps > 100
    assert stats.decode_tokens - before.decode_tokens == 8 * steps
    assert generated / steps == pytest.approx(8, rel=0.01)
    decode_s = stats.decode_s - before.decode_s
    assert decode_s == pytest.approx(5.0, rel=0.01)
    assert stats.prefill_s == before.prefill_s


def test_reports_between_step_boundaries_see_the_decode_rate() -> None:
    """Reports a fraction of a step apart (a multi-turn workload's events come every
    few milliseconds) each see the batch's decode rate, not a whole step or none of
    it; a request recalled mid-step never makes a report negative, and the reports
    still add up to the tokens generated."""
    config = _config(max_running_requests=8, kv_capacity_tokens=100_000)
    engine = _engine(config)
    engine.submit([_job(f"r{i}", 1000, 400) for i in range(8)])
    engine.advance_to(0.5)
    first = engine.stats()
    a, b = config.step_coefficients()
    step_s = a + b * first.kv_tokens
    rates = []
    t, integral = 0.5, 0.0
    for _ in range(12):
        t += step_s / 3
        engine.advance_to(t)
        rates.append(engine.stats().gen_tokens_per_s)
        integral += rates[-1] * step_s / 3
    assert min(rates) > 0
    assert max(rates) / min(rates) < 1.05
    assert statistics.fmean(rates) == pytest.approx(8 / step_s, rel=0.05)
    engine.abort([ItemId("r0"), ItemId("r1")])  # mid-step: their share of it is gone
    while engine.next_event_time() < math.inf:
        last = t
        t = min(engine.next_event_time(), t + step_s / 3)
        engine.advance_to(t)
        rate = engine.stats().gen_tokens_per_s
        assert rate >= 0.0
        integral += rate * (t - last)
    total = engine.totals().generated_tokens
    assert integral + first.gen_tokens_per_s * 0.5 == pytest.approx(total, rel=1e-9)


def test_preemption_when_kv_is_full_keeps_every_token() -> None:
    # 8 jobs that would need 8 x 2500 tokens at the end, in a 12K-token cache
    engine = _engine(_config(kv_capacity_tokens=12_000))
    jobs = [_job(f"r{i}", 500, 2000) for i in range(8)]
    engine.submit(jobs)
    done: list[JobDone] = []
    t = 0.0
    while len(done) < len(jobs):
        t += 0.05
        done += engine.advance_to(t)
        assert engine.stats().kv_usage <= 1.0
    assert engine.totals().num_preemptions > 0
    assert sorted(d.id for d in done) == sorted(j.id for j in jobs)
    assert all(d.generated_tokens == 2000 and d.context_tokens == 2500 for d in done)
    assert engine.totals().generated_tokens == 8 * 2000
    # preempted jobs re-prefill their prompt and partial output
    assert engine.totals().prefill_tokens > 8 * 500


def test_conservation_across_migrations() -> None:
    """Abort random jobs mid-flight and resubmit what is left elsewhere: every requested
    token is generated exactly once (preemptions included)."""
    rng = random.Random(7)
    engines = [_engine(_config(kv_capacity_tokens=30_000), f"e{k}") for k in range(3)]
    requested: dict[ItemId, int] = {}
    jobs: dict[ItemId, Job] = {}
    for k, engine in enumerate(engines):
        batch = [_job(f"e{k}r{i}", rng.randint(10, 800), rng.randint(1, 4000)) for i in range(40)]
        engine.submit(batch)
        for job in batch:
            requested[job.id], jobs[job.id] = job.output_tokens, job
    generated = dict.fromkeys(requested, 0)
    finished: list[ItemId] = []
    t = 0.0
    while len(finished) < len(requested):
        t += rng.uniform(0.05, 2.0)
        for engine in engines:
            for d in engine.advance_to(t):
                generated[d.id] += d.generated_tokens
                finished.append(d.id)
        src, dst = rng.sample(engines, 2)
        held = [j for j in jobs if j not in finished and rng.random() < 0.3]
        moved = []
        for progress in src.abort(held):
            generated[progress.id] += progress.generated_tokens
            jobs[progress.id] = jobs[progress.id].resume(progress)
            moved.append(jobs[progress.id])
        dst.submit(moved)
    assert sorted(finished) == sorted(requested)  # each finished exactly once
    assert generated == requested
    assert sum(e.totals().generated_tokens for e in engines) == sum(requested.values())
    assert sum(e.totals().num_preemptions for e in engines) > 0


def test_prefix_cache_reuse_after_a_tool_call() -> None:
    home, other = _engine(_config(), "home"), _engine(_config(), "other")
    home.submit([_job("a", 1000, 500, tool=True)])
    (first,) = home.advance_to(60.0)
    assert first.tool_call and first.context_tokens == 1500
    assert home.cached_prefix(ItemId("a")) == 1500
    assert home.stats().kv_usage == 0.0  # the cache is evictable, not counted as usage

    before = home.totals().prefill_tokens
    home.submit([_job("a", 1500 + 80, 300)])  # tool output: 80 tokens
    home.advance_to(120.0)
    assert home.totals().prefill_tokens - before == 80
    assert home.totals().cached_tokens == 1500

    other.submit([_job("a", 1580, 300)])  # routed away from its prefix
    other.advance_to(60.0)
    assert other.totals().prefill_tokens == 1580


def test_evicted_prefix_is_re_prefilled() -> None:
    engine = _engine(_config(kv_capacity_tokens=10_000))
    engine.submit([_job("a", 2000, 1000, tool=True)])
    engine.advance_to(60.0)
    assert engine.cached_prefix(ItemId("a")) == 3000
    # a big job needs room: the cache gives up the tail of a's prefix
    engine.submit([_job("b", 8000, 10)])
    engine.advance_to(120.0)
    kept = engine.cached_prefix(ItemId("a"))
    assert 0 < kept < 3000
    before = engine.totals().prefill_tokens
    engine.submit([_job("a", 3050, 10)])
    engine.advance_to(180.0)
    assert engine.totals().prefill_tokens - before == 3050 - kept


def test_abort_reports_progress_and_skips_unknown_ids() -> None:
    engine = _engine(_config(max_running_requests=1))
    engine.submit([_job("run", 100, 10_000), _job("wait", 100, 10)])
    engine.advance_to(2.0)
    progress = {p.id: p.generated_tokens for p in engine.abort([ItemId("run"), ItemId("gone")])}
    assert set(progress) == {"run"}
    assert 0 < progress[ItemId("run")] < 10_000
    rest = engine.abort_all()
    assert [(p.id, p.generated_tokens) for p in rest] == [("wait", 0)]
    stats = engine.stats()
    assert (stats.num_running, stats.num_queued, stats.kv_usage) == (0, 0, 0.0)
    assert engine.next_event_time() == math.inf


def test_contract_errors() -> None:
    engine = _engine(_config(kv_capacity_tokens=1000))
    with pytest.raises(SimError, match="fit the KV cache"):
        engine.submit([_job("big", 900, 200)])
    with pytest.raises(SimError, match="positive"):
        engine.submit([_job("none", 10, 0)])
    engine.submit([_job("x", 10, 10)])
    with pytest.raises(SimError, match="already on engine"):
        engine.submit([_job("x", 10, 10)])
    engine.advance_to(5.0)
    with pytest.raises(SimError, match="cannot go back"):
        engine.advance_to(4.0)
    with pytest.raises(SimError, match="raise tp"):
        _ = EngineConfig(
            gpu=H100, model=model("R1-Distill-Qwen-32B"), mem_fraction=0.7
        ).kv_tokens_capacity


def test_tensor_parallel_splits_weights_and_kv() -> None:
    big = model("R1-Distill-Qwen-32B")
    tp4 = EngineConfig(gpu=H100, model=big, tp=4, max_running_requests=160)
    a, b = tp4.step_coefficients()
    assert a > big.weight_bytes / 4 / H100.hbm_bytes_per_s
    assert b == pytest.approx(big.kv_bytes_per_token / 4 / H100.hbm_bytes_per_s)
    # 4 x 80 GB holds the 65.5 GB of weights and ≈0.8M tokens of KV
    assert 600_000 < tp4.kv_tokens_capacity < 1_000_000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_crowded_cache_thrashes_but_finishes(seed: int) -> None:
    """Many jobs in a cache a few of them fill: preemption churns, yet every job
    finishes with exactly its tokens and usage never exceeds the capacity."""
    rng = random.Random(seed)
    engine = _engine(_config(kv_capacity_tokens=2_000, max_running_requests=64))
    jobs = [_job(f"r{i}", rng.randint(1, 200), rng.randint(1, 600)) for i in range(60)]
    engine.submit(jobs)
    done: list[JobDone] = []
    t = 0.0
    while len(done) < len(jobs):
        t += 0.5
        done += engine.advance_to(t)
        assert engine.stats().kv_usage <= 1.0
        assert t < 3600, "the engine stopped making progress"
    assert {d.id: d.generated_tokens for d in done} == {j.id: j.output_tokens for j in jobs}
    assert engine.totals().num_preemptions > 0


def test_a_kv_starved_engine_retracts_rarely_and_keeps_every_token() -> None:
    """32B at TP4 holds ≈4.9K tokens per request at 160 running: with long outputs the
    cache overflows again and again. Retractions leave headroom for many steps, so they
    are rare events (far fewer than decode steps), and every token is generated once."""
    config = _config(kv_capacity_tokens=160 * 4_900, max_running_requests=160)
    rng = random.Random(5)
    jobs = [_job(f"r{i}", rng.randint(50, 1000), rng.randint(2_000, 20_000)) for i in range(400)]
    engine = _engine(config)
    engine.submit(jobs)
    done: list[JobDone] = []
    events = 0
    while len(done) < len(jobs):
        done += engine.advance_to(engine.next_event_time())
        events += 1
        assert engine.stats().kv_usage <= 1.0
    totals = engine.totals()
    assert totals.num_retractions > 0
    assert totals.num_preemptions >= totals.num_retractions
    assert totals.num_retractions < totals.num_steps / 100
    assert events < totals.num_steps / 20  # the engine jumps from event to event
    assert {d.id: d.generated_tokens for d in done} == {j.id: j.output_tokens for j in jobs}
    assert all(
        d.context_tokens == j.context_tokens + j.output_tokens
        for d, j in zip(
            sorted(done, key=lambda d: d.id), sorted(jobs, key=lambda j: j.id), strict=True
        )
    )
    assert totals.generated_tokens == sum(j.output_tokens for j in jobs)
    # retracted jobs re-prefill their prompt and partial output
    assert totals.prefill_tokens > sum(j.context_tokens for j in jobs)


def test_an_event_one_ulp_after_the_target_is_due() -> None:
    """A clock that lands a rounding error short of an event still processes it (the
    world treats events within 1e-9 s as due), so the engine never stays pending."""
    engine = _engine(_config())
    engine.submit([_job("a", 100, 50)])
    t = engine.next_event_time()
    (done,) = engine.advance_to(math.nextafter(t, 0.0))
    assert done.id == "a"
    assert engine.next_event_time() == math.inf


def test_a_cost_per_running_request_matches_a_token_by_token_reference() -> None:
    config = _config(step_per_request_s=2e-4)
    jobs = [_job(f"r{i}", 10 + 5 * i, 20 + 30 * i) for i in range(6)]
    engine = _engine(config)
    engine.submit(jobs)
    done = engine.advance_to(1e9)
    expected = _one_prefill_reference(config, jobs)
    assert {d.id: d.time_s for d in done} == pytest.approx(expected, rel=1e-9)


def _padded_reference(
    config: EngineConfig, jobs: list[Job], max_running: int
) -> dict[ItemId, float]:
    """Token by token: FIFO admission up to ``max_running``, every step reading each
    running row at the longest row's width, and the cache rebuilt (its cost per token
    held) when rows join a running batch or leave one."""
    a, b = config.step_coefficients()
    c = config.step_per_request_s
    queue = list(jobs)
    ctx: dict[ItemId, int] = {}
    left: dict[ItemId, int] = {}
    expected: dict[ItemId, float] = {}
    t = 0.0

    def read() -> int:
        return len(ctx) * max(ctx.values(), default=0)

    while queue or left:
        admitted = queue[: max_running - len(left)]
        del queue[: len(admitted)]
        if admitted:
            t += config.prefill_overhead_s + config.join_per_held_token_s * read()
            t += sum(config.prefill_s(j.context_tokens) for j in admitted)
            for j in admitted:  # the prefill samples the first token
                ctx[j.id], left[j.id] = j.context_tokens + 1, j.output_tokens - 1
            ended = [j.id for j in admitted if not left[j.id]]
            for i in ended:
                expected[i] = t
                del left[i], ctx[i]
            if ended:  # room again: admit before the next decode step
                if left:
                    t += config.leave_per_held_token_s * read()
                continue
        t += a + c * len(left) + b * read()
        finished = []
        for i in list(left):
            ctx[i] += 1
            left[i] -= 1
            if not left[i]:
                expected[i] = t
                finished.append(i)
        for i in finished:
            del left[i], ctx[i]
        if finished and left:
            t += config.leave_per_held_token_s * read()
    return expected


def test_a_padded_cache_matches_a_token_by_token_reference() -> None:
    config = _config(
        max_running_requests=3,
        step_per_request_s=1e-4,
        padded_kv=True,
        join_per_held_token_s=2e-6,
        leave_per_held_token_s=3e-6,
    )
    rng = random.Random(5)
    jobs = [_job(f"r{i}", rng.randint(4, 300), rng.randint(1, 120)) for i in range(9)]
    engine = _engine(config)
    engine.submit(jobs)
    done = engine.advance_to(1e9)
    expected = _padded_reference(config, jobs, 3)
    assert {d.id: d.time_s for d in done} == pytest.approx(expected, rel=1e-9)
    # a paged cache reads only the context held, and rebuilds nothing
    paged = _engine(_config(max_running_requests=3, step_per_request_s=1e-4))
    paged.submit(jobs)
    assert max(d.time_s for d in paged.advance_to(1e9)) < max(expected.values())


def test_a_padded_cache_reports_the_step_rate_it_reads_at() -> None:
    """Right after the prefill, a step of a short row beside a long one costs what
    both rows at the long width cost."""
    config = _config(padded_kv=True)
    engine = _engine(config)
    engine.submit([_job("long", 4000, 50), _job("short", 10, 50)])
    prefilled_s = config.prefill_overhead_s + config.prefill_s(4000) + config.prefill_s(10)
    engine.advance_to(prefilled_s)
    engine.stats()  # the window since construction
    a, b = config.step_coefficients()
    # (each row holds the token its prefill sampled)
    assert engine.stats().gen_tokens_per_s == pytest.approx(2 / (a + b * 2 * 4001), rel=1e-9)


def test_the_prefill_samples_the_first_token() -> None:
    """As in SGLang's extend batch and the torch engine's prefill step: a one-token job
    ends with its prefill, a job arriving during a prefill is admitted after it (once
    that prefill's ended jobs have left), and a job aborted mid-prefill has no token."""
    config = _config()
    engine = _engine(config)
    engine.submit([_job("one", 100, 1), _job("two", 100, 2)])
    prefill_s = config.prefill_overhead_s + 2 * config.prefill_s(100)
    engine.submit([_job("late", 50, 3)])  # mid-prefill: waits for its end
    (aborted,) = engine.abort([ItemId("two")])
    assert aborted.generated_tokens == 0  # its first token is not out yet
    done = engine.advance_to(prefill_s)
    assert [(d.id, d.time_s, d.generated_tokens) for d in done] == [("one", prefill_s, 1)]
    later = engine.advance_to(1.0)
    assert [(d.id, d.generated_tokens) for d in later] == [("late", 3)]
    (late,) = later  # its own prefill after the first, then two decode steps
    a, b = config.step_coefficients()
    late_prefill_s = config.prefill_overhead_s + config.prefill_s(50)
    assert late.time_s == pytest.approx(prefill_s + late_prefill_s + 2 * a + b * (51 + 52))
    assert engine.totals().generated_tokens == 4


def test_a_job_waiting_for_a_step_boundary_starts_when_every_running_job_is_aborted() -> None:
    """A job submitted mid-prefill waits for that prefill's end; if the prefill's jobs
    are all aborted meanwhile, it still starts (the engine does not sit idle on it)."""
    config = _config()
    engine = _engine(config)
    engine.submit([_job("a", 1000, 50)])
    engine.submit([_job("b", 10, 5)])  # mid-prefill: waits
    engine.abort([ItemId("a")])
    prefill_s = config.prefill_overhead_s + config.prefill_s(1000)
    assert engine.next_event_time() == pytest.approx(prefill_s)  # a's prefill still runs
    (done,) = engine.advance_to(1.0)
    assert (done.id, done.generated_tokens) == ("b", 5)
    assert done.time_s > prefill_s + config.prefill_overhead_s


def test_a_resumed_jobs_re_prefill_is_counted_apart() -> None:
    # A job taken from an engine with partial output re-prefills its context on the
    # next: the engine reports those seconds apart from its prefills of fresh jobs
    # (in the same prefill, in proportion to their FLOPs).
    config = _config()
    home = _engine(config, "home")
    home.submit([_job("a", 3000, 500)])
    home.advance_to(1.0)
    assert home.stats().resume_prefill_s == 0.0
    (progress,) = home.abort([ItemId("a")])
    assert progress.generated_tokens > 0
    resumed = _job("a", 3000, 500).resume(progress)
    assert resumed.resumed
    other = _engine(config, "other")
    other.submit([resumed, _job("b", 1000, 500)])
    stats = other.stats()
    moved_s, fresh_s = config.prefill_s(resumed.context_tokens), config.prefill_s(1000)
    assert stats.prefill_s == pytest.approx(config.prefill_overhead_s + moved_s + fresh_s)
    assert stats.resume_prefill_s == pytest.approx(stats.prefill_s * moved_s / (moved_s + fresh_s))
    # Taken out before its prefill ended, a job has generated nothing: no re-prefill.
    (early,) = other.abort([ItemId("b")])
    assert early.generated_tokens == 0
    assert not _job("b", 1000, 500).resume(early).resumed
