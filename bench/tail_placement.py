"""What placing the longest requests on engines of their own would buy: an oracle.

The tail floor (``dynarl.sim.tail_floor``) assumes the rollout's longest responses run
from the start on engines of their own while the rest of the work fills the other
devices at full efficiency. Seer-style request placement aims at that: learn a group's
length from its first finishers and segregate the longest. This bench asks the model
how much such placement could buy at best, with every length known up front (an
oracle: no predictor does better): the requests of the iteration's longest length (the
capped ones on the math workloads) go only to ``E_c`` of the engines, the others only
to the rest, and the router's balancing moves requests within each class, never
across. ``E_c = 0`` is the router as it is (every engine takes a mix).

It runs ``static-colocated`` (the rollout holds every device, so only the placement
differs) and prints, per row and ``E_c``, when the longest requests finish, when the
others do (the rollout's end is the later), and the iteration time; then one JSON line
``{"bench": "tail_placement", "rows": [...]}``. The model's answer (see
docs/simulator-history.md, "Request placement against the tail"): segregation moves
the two finishing times in opposite directions, and where they cross the rollout ends
no sooner than with the mix.

``--rows math-1.5b-64,math-7b-64`` picks rows, ``--shares`` the fractions of engines
given to the longest requests, ``--jobs`` runs that many simulations at once.
"""

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np
from recipes.paper import paper_setting

from dynarl.control import events as ev
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.data.balance import Balancer
from dynarl.data.component_peers import ComponentPeers
from dynarl.data.routing import AffinityRouting
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.run import simulate

ROLLOUT_EDGE = "prompts"


def longest_ids(run: SimulatedRun, iterations: int) -> set[str]:
    """The ids of each iteration's requests of its longest length (the workload's own
    draws: the simulator generates the same, from the run's seed)."""
    cluster = build_cluster(run)
    rng = np.random.default_rng(run.job.run.seed)
    ids: set[str] = set()
    for it in range(iterations):
        requests = cluster.workload.generate(rng, iteration=it)
        length = max(sum(r.output_tokens) for r in requests)
        ids |= {r.id for r in requests if sum(r.output_tokens) == length}
    return ids


@contextmanager
def segregated(long_ids: set[str], num_engines: int, e_c: int) -> Iterator[None]:
    """Route the ``long_ids`` requests only to engines ``serial % num_engines < e_c``
    and the others only to the rest; balance within each class only."""

    def is_long_engine(instance: str) -> bool:
        return int(instance.rsplit("-", 1)[1]) % num_engines < e_c

    select = AffinityRouting.select
    balance_for = Balancer.balance_for

    def routed(self: AffinityRouting, item: Any, previous: Any, candidates: Any) -> Any:
        if item.edge != ROLLOUT_EDGE:
            return select(self, item, previous, candidates)
        want = item.id in long_ids
        pool = [c for c in candidates if is_long_engine(c.instance) == want]
        return select(self, item, previous, pool)

    def balanced(self: Balancer, w: Any, now: float, *, tail: bool = False) -> None:
        if not str(w.instance).startswith("rollout"):
            balance_for(self, w, now, tail=tail)
            return
        mine = is_long_engine(w.instance)
        everyone = self.peers
        own = ComponentPeers()
        own.queued, own.in_flight = everyone[w.component].queued, everyone[w.component].in_flight
        own.refresh(c for c in everyone[w.component].active if is_long_engine(c.instance) == mine)
        self.peers = {**everyone, w.component: own}
        try:
            balance_for(self, w, now, tail=tail)
        finally:
            self.peers = everyone

    if e_c == 0:
        yield
        return
    with (
        mock.patch.object(AffinityRouting, "select", routed),
        mock.patch.object(Balancer, "balance_for", balanced),
    ):
        yield


def run_one(row: str, share: float, iterations: int) -> dict[str, Any]:
    """One static-colocated simulation of ``row`` with ``share`` of the engines for the
    longest requests (0: the router's own mix); times of the measured iteration."""
    workload, size, devices = row.split("-")
    cfg = paper_setting(
        workload,  # type: ignore[arg-type]
        size,  # type: ignore[arg-type]
        int(devices),
        mode="static-colocated",
        num_iterations=iterations,
    )
    run = simulated_run(cfg, [f"run.seed={cfg.job.run.seed}"])
    num_engines = int(devices) // build_cluster(run).engine.tp
    e_c = round(share * num_engines)
    long_ids = longest_ids(run, iterations)
    log: list[ev.Event] = []
    with (
        segregated(long_ids, num_engines, e_c),
        asyncio.Runner(loop_factory=VirtualTimeLoop) as runner,
    ):
        runner.run(simulate(run, on_event=log.append))
    last = iterations - 1
    start = next(
        e.time_s for e in log if isinstance(e, ev.IterationStarted) and e.iteration == last
    )
    end = next(e.time_s for e in log if isinstance(e, ev.IterationDone) and e.iteration == last)
    done = [
        e
        for e in log
        if isinstance(e, ev.ItemCompleted) and e.edge == ROLLOUT_EDGE and start <= e.time_s <= end
    ]
    longest = [e.time_s - start for e in done if e.item in long_ids]
    others = [e.time_s - start for e in done if e.item not in long_ids]
    return {
        "setting": row,
        "share": share,
        "engines_for_longest": e_c,
        "num_engines": num_engines,
        "num_longest": len(longest),
        "longest_done_s": round(max(longest), 2),
        "others_done_s": round(max(others), 2),
        "rollout_s": round(max(longest + others), 2),
        "iteration_s": round(end - start, 2),
    }


def _job(args: tuple[str, float, int]) -> dict[str, Any]:
    return run_one(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="math-1.5b-64,math-7b-64")
    parser.add_argument("--shares", default="0,0.375,0.5,0.625,0.75")
    parser.add_argument("--iterations", type=int, default=2, help="the first is warm-up")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once")
    args = parser.parse_args()
    jobs = [
        (row, float(share), args.iterations)
        for row in args.rows.split(",")
        for share in args.shares.split(",")
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, jobs))
    print(
        f"{'setting':<14} {'engines for longest':>20} {'longest done s':>15} "
        f"{'others done s':>14} {'rollout s':>10} {'iteration s':>12}"
    )
    for r in results:
        engines = f"{r['engines_for_longest']}/{r['num_engines']}" if r["share"] else "mixed"
        print(
            f"{r['setting']:<14} {engines:>20} {r['longest_done_s']:>15.1f} "
            f"{r['others_done_s']:>14.1f} {r['rollout_s']:>10.1f} {r['iteration_s']:>12.1f}"
        )
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    print(json.dumps({"bench": "tail_placement", "rows": results}))


if __name__ == "__main__":
    main()
