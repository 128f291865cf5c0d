"""What knowing every response's length would buy the dynamic scheduler: an oracle.

The scheduler predicts the rollout's remaining work from the last iteration's lengths
(:mod:`dynarl.control.rollout_lengths`: the survivors past each request's progress,
the median of their maximum, the order requests complete in) and, from that, when each
of the trainer's minibatches fills (:mod:`dynarl.control.trainer_steps`). A better
length model -- a per-group posterior learnt from a group's first finishers (Seer), a
learnt predictor -- can at best know every length. This bench gives the scheduler that:
with ``--oracle``, every pending request's remaining length is its true final length
(the workload's own draw) less its progress, so the mean and longest remainders, the
completion order and each group's completion are exact as of the hypergraph's state
(its progress estimates, which come from the engines' reports, stay as they are).

Per row and seed it runs ``dynamic`` twice side by side -- the model's estimates and
the oracle's -- and prints the measured iterations' mean time, the migrations and the
committed plans' prediction error (:mod:`dynarl.sim.plan_accuracy`: median of
``predicted / actual - 1``, 90th percentile of its size); then one JSON line
``{"bench": "length_oracle", "rows": [...]}``. If the oracle's times are no better, the
length model is not what stands between the scheduler and a faster iteration, however
much it improves the predictions.

``--rows`` picks rows, ``--seeds`` the workload seeds, ``--jobs`` runs that many
simulations at once.
"""

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np
from recipes.paper import paper_setting

from dynarl.control import rollout_lengths, trainer_steps
from dynarl.control.elements import TOOL
from dynarl.control.estimates import Estimates
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.rollout_lengths import Completions
from dynarl.core.ids import ComponentId, GroupId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.run import simulate

ROWS = (
    "math-1.5b-64,math-7b-64,math-32b-64,math-1.5b-128,math-7b-128,math-32b-128,"
    "agentic-7b-64,agentic-1.5b-128,agentic-32b-64"
)
_ORDER_BUCKETS = 16  # as rollout_lengths' completion order


def true_lengths(run: SimulatedRun, iterations: int) -> dict[str, int]:
    """Every request's response length, over all turns, per iteration of ``run`` (the
    workload's own draws: the simulator generates the same, from the run's seed)."""
    cluster = build_cluster(run)
    rng = np.random.default_rng(run.job.run.seed)
    out: dict[str, int] = {}
    for it in range(iterations):
        out.update(
            {r.id: r.total_output_tokens for r in cluster.workload.generate(rng, iteration=it)}
        )
    return out


class _Oracle:
    """The pending requests' true remainders, per state of the hypergraph."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths
        self._key: tuple[int, int, ComponentId] | None = None
        self._pending: list[tuple[float, float, GroupId]] = []

    def pending(
        self, graph: Hypergraph, component: ComponentId
    ) -> list[tuple[float, float, GroupId]]:
        """(remaining tokens, final length, group) of every pending request, ascending."""
        key = (id(graph), graph.events_applied, component)
        if key != self._key:
            out = []
            for edge in graph.edges_into(component):
                for st in edge.items.values():
                    owner = st.owner
                    progress = (
                        st.generated
                        if owner is None or owner == TOOL
                        else graph.instances[owner].progress_of(st)
                    )
                    final = self.lengths.get(st.id)
                    if final is None:
                        raise KeyError(f"the oracle does not know request {st.id!r}")
                    out.append((max(1.0, final - progress), float(final), st.group))
            out.sort()
            self._key, self._pending = key, out
        return self._pending


@contextmanager
def oracle(lengths: dict[str, int]) -> Iterator[None]:
    """Replace the scheduler's length estimates with the true lengths."""
    known = _Oracle(lengths)
    model_remaining = rollout_lengths.expected_remaining_tokens

    def remaining(graph: Hypergraph, component: ComponentId) -> float:
        pending = known.pending(graph, component)
        if not pending:
            return model_remaining(graph, component)
        return statistics.fmean(r for r, _, _ in pending)

    def longest(graph: Hypergraph, component: ComponentId, est: Estimates) -> float:
        return known.pending(graph, component)[-1][0]

    def order(graph: Hypergraph, component: ComponentId, est: Estimates) -> Completions:
        pending = known.pending(graph, component)
        n, top = len(pending), max(pending[-1][0], 1.0)
        times, means = [], []
        for b in range(_ORDER_BUCKETS):
            chunk = pending[b * n // _ORDER_BUCKETS : (b + 1) * n // _ORDER_BUCKETS]
            chunk = chunk or [pending[min(n - 1, b * n // _ORDER_BUCKETS)]]
            times.append(min(1.0, chunk[-1][0] / top))
            means.append(statistics.fmean(f for _, f, _ in chunk))
        return Completions(tuple(times), tuple(means))

    def groups_done(
        graph: Hypergraph, rollout: ComponentId, groups: dict[GroupId, list[float]], est: Estimates
    ) -> None:
        # Each group completes with its longest pending request; its requests' work is
        # their prompts and final lengths.
        pending = known.pending(graph, rollout)
        top = max((r for r, _, _ in pending), default=1.0)
        last: dict[GroupId, list[float]] = {}
        for r, final, group in pending:
            g = last.setdefault(group, [0.0, 0.0])
            g[0], g[1] = max(g[0], r), g[1] + final
        for group, g in groups.items():
            if g[3] and group in last:
                g[2] = max(g[2], min(1.0, last[group][0] / max(top, 1.0)))
                g[1] += g[4] + last[group][1]

    with (
        mock.patch.object(rollout_lengths, "expected_remaining_tokens", remaining),
        mock.patch.object(rollout_lengths, "_longest", longest),
        mock.patch.object(rollout_lengths, "_completion_order", order),
        mock.patch.object(trainer_steps, "_rollout_groups", groups_done),
    ):
        yield


def run_one(row: str, seed: int, use_oracle: bool, iterations: int) -> dict[str, Any]:
    """One ``dynamic`` simulation of ``row`` (``seed`` added to the recipe's)."""
    workload, size, devices = row.split("-")
    cfg = paper_setting(
        workload,  # type: ignore[arg-type]
        size,  # type: ignore[arg-type]
        int(devices),
        mode="dynamic",
        num_iterations=iterations,
    )
    run = simulated_run(cfg, [f"run.seed={cfg.job.run.seed + seed}"])
    lengths = true_lengths(run, iterations) if use_oracle else None
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        if lengths is None:
            result, _ = runner.run(simulate(run))
        else:
            with oracle(lengths):
                result, _ = runner.run(simulate(run))
    acc = result.plan_accuracy
    return {
        "setting": row,
        "seed": seed,
        "oracle": use_oracle,
        "iteration_s": round(result.mean_iteration_s, 2),
        "migrations": result.num_migrations,
        "plan_error": {"median": round(acc.median, 3), "p90_abs": round(acc.p90_abs, 3)},
    }


def _job(args: tuple[str, int, bool, int]) -> dict[str, Any]:
    return run_one(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds per row")
    parser.add_argument("--iterations", type=int, default=2, help="the first is warm-up")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    args = parser.parse_args()
    rows = args.rows.split(",")
    jobs = [
        (row, seed, use, args.iterations)
        for row in rows
        for seed in range(args.seeds)
        for use in (False, True)
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, jobs))
    print(
        f"{'setting':<17} {'model s':>9} {'oracle s':>9} {'change':>7} {'per seed':>20} "
        f"{'migr':>9} {'plan err model':>15} {'plan err oracle':>16}"
    )
    summary = []
    for row in rows:
        model = [r for r in results if r["setting"] == row and not r["oracle"]]
        known = [r for r in results if r["setting"] == row and r["oracle"]]
        m = statistics.fmean(r["iteration_s"] for r in model)
        o = statistics.fmean(r["iteration_s"] for r in known)
        per_seed = [
            b["iteration_s"] / a["iteration_s"] - 1 for a, b in zip(model, known, strict=True)
        ]

        def err(rs: list[dict[str, Any]]) -> str:
            med = statistics.fmean(r["plan_error"]["median"] for r in rs)
            p90 = max(r["plan_error"]["p90_abs"] for r in rs)
            return f"{med:+.0%} / {p90:.0%}"

        print(
            f"{row:<17} {m:>9.1f} {o:>9.1f} {o / m - 1:>+7.1%} "
            f"{' '.join(f'{x:+.1%}' for x in per_seed):>20} "
            f"{sum(r['migrations'] for r in model):>4}/{sum(r['migrations'] for r in known):<4} "
            f"{err(model):>15} {err(known):>16}"
        )
        summary.append(
            {
                "setting": row,
                "model_s": round(m, 2),
                "oracle_s": round(o, 2),
                "change": round(o / m - 1, 4),
                "per_seed": [round(x, 4) for x in per_seed],
            }
        )
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    print(json.dumps({"bench": "length_oracle", "rows": summary, "runs": results}))


if __name__ == "__main__":
    main()
