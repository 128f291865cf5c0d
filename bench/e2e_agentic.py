"""Dynamic vs static scheduling on a multi-turn agentic job, measured for real on the
CPU reference workers.

The ``agentic_tiny`` recipe (the lookup environment: episodes of tool calls through
the data router's sessions) under ``dynamic``, ``dynamic`` with the priority-aware
request queue (``rollout.request_order=priority``), ``static-colocated`` and
``static-disaggregated``, side by side in one process, their iterations interleaved
as in ``bench/e2e_cpu.py``. Every mode starts from the same weights: the recipe's
warm start runs once and every mode loads it (``model.path``). Iteration 0 builds every
role and is left out of the means (``--warmup``).

Every variant takes its old log-probs from the same place (``--old-logprobs``: the
engines' own, or recomputed on the inference stage), so every variant does the same
work.

``--variants ... dynamic+partial static-colocated+partial`` adds partial rollouts
(``algorithm.over_sample_prompts``, ``--over-sample`` of them, staleness 1): episodes
still playing when the rollout ends carry over mid-session; the JSON line then gives
each against its on-policy variant (``partial_vs_on_policy``, trained episodes/s).

Per mode: generated tokens/s, episodes/s (trained), mean iteration time, stage times,
migrations, and the reward and tool-call-rate curves. Ends with a table and one JSON
line::

    python bench/e2e_agentic.py [--iterations 5] [--old-logprobs rollout|inference]
        [--variants ...] [--over-sample 8] [--set key=value ...]
"""

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from recipes import agentic_tiny

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from e2e_cpu import ModeRun, open_run, step, summarise

VARIANTS: dict[str, list[str]] = {
    "dynamic": ["scheduler.mode=dynamic", "rollout.request_order=fifo"],
    "dynamic+priority": ["scheduler.mode=dynamic", "rollout.request_order=priority"],
    "static-colocated": ["scheduler.mode=static-colocated", "rollout.request_order=fifo"],
    "static-disaggregated": ["scheduler.mode=static-disaggregated", "rollout.request_order=fifo"],
    # Partial rollouts (``--over-sample`` groups beyond num_prompts, staleness 1):
    # episodes still playing at the rollout's end carry over mid-session.
    "dynamic+partial": ["scheduler.mode=dynamic", "rollout.request_order=fifo"],
    "static-colocated+partial": [
        "scheduler.mode=static-colocated",
        "rollout.request_order=fifo",
    ],
}
DEFAULT_VARIANTS = [v for v in VARIANTS if not v.endswith("+partial")]

OLD_LOGPROBS: dict[str, list[str]] = {
    # The engines' own log-probs: no inference stage in any mode (the recipe's four
    # slots start rollout 2, actor 1, one free; dynamic modes move it as they see fit).
    "rollout": ["algorithm.old_logprobs=rollout", "inference.initial_devices=0"],
    # Recomputed on the inference stage in every mode (the fixed split: rollout 2,
    # inference 1, actor 1).
    "inference": ["algorithm.old_logprobs=inference", "inference.initial_devices=1"],
}
"""Where old log-probs come from, the same in every variant (the work is the same)."""


async def warm_start(args: argparse.Namespace, out: Path) -> Path:
    """Run the recipe's warm start once (a zero-iteration run); its checkpoint."""
    cfg = apply_overrides(
        agentic_tiny(), [f"run.run_dir={out / 'warm'}", "run.num_iterations=1", *args.set]
    )
    path = out / "warm" / "warm_start"
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        async with DynaRL(cfg):
            pass
        print(f"warm start in {time.perf_counter() - t0:.1f} s", flush=True)
    return path.resolve()


def variant_config(name: str, args: argparse.Namespace, out: Path, warm: Path) -> DynaRLConfig:
    sets = [
        f"run.run_dir={out / name}",
        f"run.num_iterations={args.iterations}",
        f"model.path={warm}",
        "model.tokenizer=null",  # the warm start brings its tokenizer
        "env.warm_start_steps=0",
        *VARIANTS[name],
        *OLD_LOGPROBS[args.old_logprobs],
    ]
    if name.endswith("+partial"):
        sets += [f"algorithm.over_sample_prompts={args.over_sample}", "algorithm.max_staleness=1"]
    return apply_overrides(agentic_tiny(), [*sets, *args.set])


async def measure(runs: list[ModeRun], args: argparse.Namespace) -> None:
    async with contextlib.AsyncExitStack() as stack:
        for run in runs:
            await open_run(stack, run)
        for _ in range(args.iterations):
            for run in runs:
                await step(run, args.iteration_limit_s)


def episodes_summary(run: ModeRun, warmup: int) -> dict[str, Any]:
    measured = run.stats[warmup:] or run.stats
    if not measured:
        return {}
    elapsed = sum(s.elapsed_s for s in measured)
    return {
        "episodes_per_s": sum(s.num_samples for s in measured) / elapsed,
        "tool_call_rate_curve": [
            round(s.episodes.get("tool_call_rate", 0.0), 3) for s in run.stats
        ],
        "turns": sum(s.episodes.get("turns", 0.0) for s in measured) / len(measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out of means")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument(
        "--over-sample",
        type=int,
        default=8,
        help="algorithm.over_sample_prompts of the +partial variants (of 16 prompts)",
    )
    parser.add_argument("--out", default="runs/e2e_agentic", help="parent of the run directories")
    parser.add_argument("--iteration-limit-s", type=float, default=600.0)
    parser.add_argument(
        "--old-logprobs",
        choices=list(OLD_LOGPROBS),
        default="rollout",
        help="where every variant's old log-probs come from (the same work in each)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    out = Path(args.out)
    t0 = time.perf_counter()
    warm = anyio.run(warm_start, args, out)
    runs = []
    for name in args.variants:
        run = ModeRun(name, variant_config(name, args, out, warm))  # type: ignore[arg-type]
        runs.append(run)
    asyncio.run(measure(runs, args))
    wall_s = time.perf_counter() - t0
    summary = {r.mode: summarise(r, args.warmup) | episodes_summary(r, args.warmup) for r in runs}
    ok = {m: s for m, s in summary.items() if s.get("tokens_per_s")}
    print()
    print(
        f"{'variant':22s} {'tok/s':>7s} {'ep/s':>6s} {'iter s':>7s} {'rollout':>7s} "
        f"{'train':>6s} {'migr/it':>7s}  reward curve / tool-call rate"
    )
    for name, s in ok.items():
        st = s["stage_s"]
        print(
            f"{name:22s} {s['tokens_per_s']:7.0f} {s['episodes_per_s']:6.1f} "
            f"{s['mean_iteration_s']:7.2f} {st.get('rollout', 0):7.2f} {st.get('train', 0):6.2f} "
            f"{s['migrations_per_iteration']:7.1f}  {s['reward_curve']} / "
            f"{s['tool_call_rate_curve']}"
        )
    static = [
        ok[m]["episodes_per_s"] for m in ("static-colocated", "static-disaggregated") if m in ok
    ]
    best = max(static) if static else None
    record = {
        "bench": "e2e_agentic",
        "iterations": args.iterations,
        "old_logprobs": args.old_logprobs,
        "warmup": args.warmup,
        "episodes_per_s": {m: round(s["episodes_per_s"], 2) for m, s in ok.items()},
        "tokens_per_s": {m: round(s["tokens_per_s"], 1) for m, s in ok.items()},
        "mean_iteration_s": {m: round(s["mean_iteration_s"], 3) for m, s in ok.items()},
        "speedup_vs_best_static": {
            m: round(ok[m]["episodes_per_s"] / best, 3)
            for m in ("dynamic", "dynamic+priority", "dynamic+partial")
            if m in ok and best
        },
        "partial_vs_on_policy": {
            m: round(ok[m]["episodes_per_s"] / ok[base]["episodes_per_s"], 3)
            for m in ok
            if m.endswith("+partial") and (base := m.removesuffix("+partial")) in ok
        },
        "over_sample_prompts": args.over_sample,
        "migrations_per_iteration": {m: s["migrations_per_iteration"] for m, s in ok.items()},
        "reward_curves": {m: s["reward_curve"] for m, s in ok.items()},
        "tool_call_rate_curves": {m: s["tool_call_rate_curve"] for m, s in ok.items()},
        "errors": {m: s["error"] for m, s in summary.items() if s.get("error")},
        "wall_s": round(wall_s, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_agentic.json").write_text(json.dumps({"summary": summary, **record}, indent=1))
    print(json.dumps(record))
    sys.exit(0 if len(ok) == len(runs) else 1)


if __name__ == "__main__":
    main()
