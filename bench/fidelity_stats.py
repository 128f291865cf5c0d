"""The statistics ``bench/sim_fidelity.py`` sets a replay against its real run with:
per-iteration errors and their bootstrap interval, where an error sits (rollout or
after it; engine steps by kind), and which modes the real run tells apart.

Every real mode ran the same prompts iteration by iteration, interleaved, so an
iteration of one mode is paired with the same iteration of another (and of the replay):
the pairing takes the prompts' own variation out of every comparison.
"""

import math
import statistics
from collections.abc import Mapping
from typing import TypeVar

import numpy as np

from e2e_cpu import ModeRun

Mode = TypeVar("Mode", bound=str)


def paired_errors(run: ModeRun, sim: dict[int, float], warmup: int) -> list[float]:
    """Simulated (``sim``: by iteration) over measured time of each measured iteration,
    minus one (the replay runs the same prompts and lengths, iteration by iteration)."""
    return [
        sim[s.iteration] / s.elapsed_s - 1.0
        for s in run.stats[warmup:]
        if s.iteration in sim and s.elapsed_s > 0
    ]


def error_interval(
    run: ModeRun, sim: dict[int, float], warmup: int, *, draws: int = 2000, level: float = 0.9
) -> tuple[float, float]:
    """A bootstrap interval (``level``) of the mean-time error over the measured
    iterations: iterations resampled with replacement, simulated (``sim``: by
    iteration) over measured total time each draw. On a shared 2-core machine one real
    iteration's time moves by tens of percent with the other tenants, so a handful of
    iterations pins the error down only to within about that over their square root."""
    pairs = np.array(
        [(sim[s.iteration], s.elapsed_s) for s in run.stats[warmup:] if s.iteration in sim]
    )
    if len(pairs) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(pairs), size=(draws, len(pairs)))
    ratios = pairs[picks, 0].sum(axis=1) / pairs[picks, 1].sum(axis=1) - 1.0
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def stage_split(
    run: ModeRun, rollout_s: dict[int, float], sim: dict[int, float], warmup: int
) -> dict[str, tuple[float, float]]:
    """Mean (real, simulated) seconds of the rollout (the real ``stage_s["rollout"]``;
    the replay's start to its last rollout completion) and of the rest of the iteration
    after it, over the measured iterations the replay has: which part the error is in."""
    pairs = [
        (s.stage_s.get("rollout", math.nan), s.elapsed_s, rollout_s[s.iteration], sim[s.iteration])
        for s in run.stats[warmup:]
        if s.iteration in rollout_s and s.iteration in sim
    ]
    if not pairs:
        return {}
    real_roll, real_all, sim_roll, sim_all = (statistics.mean(c) for c in zip(*pairs, strict=True))
    return {
        "rollout": (real_roll, sim_roll),
        "after_rollout": (real_all - real_roll, sim_all - sim_roll),
    }


STEP_PARTS = ("prefill_steps", "decode_steps", "prefill_step_ms", "decode_step_ms")


def step_split(
    run: ModeRun, sim_steps: dict[int, dict[str, float]], warmup: int
) -> dict[str, tuple[float, float]]:
    """Mean (real, simulated) engine steps an iteration, by kind, and the mean step of
    each kind in ms (summed over the engines, over the measured iterations both
    counted): whether the replay takes the real engines' steps, and what a step costs
    in each. The real step is the engine's own ``step()``, the worker loop around it
    not included; a simulated step includes its share of the loop
    (``step_dispatch_s``)."""
    pairs = [
        (s.engine_steps, sim_steps[s.iteration])
        for s in run.stats[warmup:]
        if s.engine_steps and s.iteration in sim_steps
    ]
    if not pairs:
        return {}

    def parts(steps: dict[str, float]) -> tuple[float, ...]:
        prefills, decodes = steps.get("prefill_steps", 0.0), steps.get("decode_steps", 0.0)
        return (
            prefills,
            decodes,
            1e3 * steps.get("prefill_s", 0.0) / prefills if prefills else math.nan,
            1e3 * steps.get("decode_s", 0.0) / decodes if decodes else math.nan,
        )

    real = [parts(r) for r, _ in pairs]
    sim = [parts(v) for _, v in pairs]
    return {
        name: (statistics.mean(r[k] for r in real), statistics.mean(v[k] for v in sim))
        for k, name in enumerate(STEP_PARTS)
    }


def ranking(times: Mapping[Mode, float]) -> list[Mode]:
    """Modes from fastest to slowest."""
    return sorted(times, key=times.__getitem__)


# Student's t at 0.95 (a two-sided 90% interval) for 1..30 degrees of freedom; past 30,
# the normal's 1.645 (t is within 2% of it there).
_T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip


def separated_pairs(runs: Mapping[Mode, ModeRun], warmup: int) -> list[tuple[Mode, Mode]]:
    """The pairs ``(faster, slower)`` of modes the real run tells apart: the mean of
    the log of their per-iteration time ratios (iterations paired; in logs, since the
    iterations' lengths differ severalfold as responses shorten) has a 90% Student-t
    interval that excludes 0. Modes whose difference this machine's noise covers are left out: a
    replay cannot be held to their order. (A bootstrap, as :func:`error_interval`
    uses, is no test on 3 iterations: one iteration of three against the others still
    leaves only 1 resample in 27 on its side.)"""
    times = {m: {s.iteration: s.elapsed_s for s in run.stats[warmup:]} for m, run in runs.items()}
    modes = sorted(times)
    out: list[tuple[Mode, Mode]] = []
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            shared = sorted(times[a].keys() & times[b].keys())
            diffs = [
                math.log(times[a][k] / times[b][k])
                for k in shared
                if times[a][k] > 0 and times[b][k] > 0
            ]
            if len(diffs) < 2:
                continue
            mean = statistics.mean(diffs)
            df = len(diffs) - 1
            half = (_T95[df - 1] if df <= len(_T95) else 1.645) * statistics.stdev(diffs)
            half /= math.sqrt(len(diffs))
            if mean + half < 0:
                out.append((a, b))
            elif mean - half > 0:
                out.append((b, a))
    return out
