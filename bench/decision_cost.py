"""What the scheduler's real decisions cost, replayed on the states they were made in.

The online overhead that ``bench/sim_paper.py`` reports (decision wall-clock over
simulated time) moves by +-20% between runs of the same code on a shared machine, more
than most changes to the scheduler's speed. This benchmark measures those decisions
reproducibly: it simulates an on-policy row (dynamic mode, 2 iterations, seed 0),
pickles the hypergraph, the policy, the hold and the trigger at every ``--every``-th
decision, then times each one again on its own state, ``--repeats`` times, keeping the
fastest: the whole decision (the policy, then the trainer's hold), the policy and the
hold alone, and parts of the demand model (all demands; the pending requests'
progress; the trainer's step plan). Every timing starts from a fresh state of the
hypergraph (its estimates computed afresh), as each decision of a run does.

With ``--base DIR`` (the ``src`` of another checkout, say a ``git worktree`` of
``main``), each row runs in a subprocess per version, alternating, twice each, and the
table gives both and their ratio; the simulations are deterministic, so both versions
replay the same decisions -- as long as both decide at the same moments (a version
that asks the policy at other triggers samples other states: compare its total
decision time instead, from the second table). The second table counts each
version's decisions by the trigger that asked for them, and those the policy
answered with a plan, from its simulation. Prints both tables and one JSON line.

    python bench/decision_cost.py --rows agentic-1.5b-128 math-1.5b-128 --base /tmp/main/src
"""

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PARTS = ("decision", "policy", "hold", "demands", "progress", "steps")


def _snapshots(row: str, every: int) -> tuple[list[bytes], dict[str, dict[str, float]]]:
    """The pickled states of every ``every``-th decision of ``row``'s simulation, and
    its decisions by trigger (how many, how many with a plan, their wall-clock ms in
    the simulation: noisy, unlike the replays)."""
    import sim_paper
    from dynarl.control import controller

    taken: list[bytes] = []
    decide = controller.Controller.decide
    count = 0
    seen: list[Any] = []

    def taking(self: Any, trigger: Any) -> Any:
        nonlocal count
        count += 1
        if not seen:
            seen.append(self)
        if count % every == 0:
            taken.append(pickle.dumps((self.graph, self.policy, self.hold, trigger)))
        return decide(self, trigger)

    controller.Controller.decide = taking  # type: ignore[method-assign]
    try:
        workload, size, devices = row.split("-")
        sim_paper.run_one(workload, size, int(devices), "dynamic", iterations=2, seed=0)
    finally:
        controller.Controller.decide = decide  # type: ignore[method-assign]
    # (A checkout from before the controller counted by trigger has none.)
    kinds = getattr(seen[0].statistics(), "triggers", {}) if seen else {}
    triggers = {
        k: {"decisions": t.decisions, "plans": t.plans, "ms": round(1e3 * t.total_s, 1)}
        for k, t in sorted(kinds.items(), key=lambda kv: -kv[1].total_s)
    }
    return taken, triggers


def _fastest(fn: Callable[[], object], fresh: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        fresh()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _time_one(blob: bytes, repeats: int) -> dict[str, float]:
    """Seconds of each part of one pickled decision (the fastest of ``repeats``)."""
    from dynarl.control import rollout_lengths, scoring, trainer_steps
    from dynarl.control.estimates import Estimates

    graph, policy, hold, trigger = pickle.loads(blob)
    kinds = {n.spec.kind: c for c, n in graph.components.items()}

    def fresh() -> None:
        graph.events_applied += 1  # a new state: every estimate is computed again

    def decision() -> None:
        policy.decide(graph, trigger)
        if hold is not None:
            hold.holds(graph)

    def steps() -> None:
        actor = kinds.get("actor")
        node = graph.components[actor] if actor is not None else None
        if node is not None and node.spec.steps_in_arrival_order and graph.sized:
            left = max(node.steps_left, 1)
            if left > 1:
                trainer_steps.steps_in_arrival_order(graph, actor, left, Estimates())

    parts: dict[str, Callable[[], object]] = {
        "decision": decision,
        "policy": lambda: policy.decide(graph, trigger),
        "hold": lambda: hold.holds(graph) if hold is not None else None,
        "demands": lambda: scoring.demands(graph, estimates=Estimates()),
        "progress": lambda: rollout_lengths.pending_progress(graph, kinds["rollout"]),
        "steps": steps,
    }
    return {name: _fastest(fn, fresh, repeats) for name, fn in parts.items()}


def measure(row: str, every: int, repeats: int) -> dict[str, Any]:
    """Mean ms per decision of each part over ``row``'s sampled decisions."""
    blobs, triggers = _snapshots(row, every)
    totals = dict.fromkeys(PARTS, 0.0)
    for blob in blobs:
        for name, seconds in _time_one(blob, repeats).items():
            totals[name] += seconds
    n = max(len(blobs), 1)
    ms = {k: 1e3 * v / n for k, v in totals.items()}
    return {"row": row, "decisions": len(blobs), "ms": ms, "triggers": triggers}


def _in_subprocess(src: str, row: str, every: int, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(HERE)]))
    args = [sys.executable, __file__, "--measure", row, "--every", str(every)]
    out = subprocess.run(
        [*args, "--repeats", str(repeats)], env=env, check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["agentic-1.5b-128", "math-1.5b-128"])
    parser.add_argument("--every", type=int, default=25, help="sample every n-th decision")
    parser.add_argument("--repeats", type=int, default=7, help="timings per decision (fastest)")
    parser.add_argument("--base", help="src directory of another checkout to compare with")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one row, in a subprocess
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.every, args.repeats)))
        return
    head_src = str(HERE.parent / "src")
    versions = {"head": head_src} | ({"base": args.base} if args.base else {})
    results: dict[str, dict[str, dict[str, float]]] = {}
    by_trigger: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for row in args.rows:
        best: dict[str, dict[str, float]] = {}
        for _ in range(2):  # alternating, so both meet the machine in the same moods
            for version, src in versions.items():
                measured = _in_subprocess(src, row, args.every, args.repeats)
                ms = measured["ms"]
                seen = best.setdefault(version, ms)
                best[version] = {k: min(v, seen[k]) for k, v in ms.items()}
                by_trigger.setdefault(row, {})[version] = measured.get("triggers", {})
        results[row] = best
    header = f"{'row':18s} {'part':9s} {'head ms':>9s}"
    if args.base:
        header += f" {'base ms':>9s} {'head/base':>9s}"
    print(header)
    for row, best in results.items():
        for part in PARTS:
            line = f"{row:18s} {part:9s} {best['head'][part]:9.3f}"
            if args.base:
                base = best["base"][part]
                ratio = best["head"][part] / base if base > 0 else float("nan")
                line += f" {base:9.3f} {ratio:9.2f}"
            print(line)
    print()
    print(
        f"{'row':18s} {'trigger':18s} {'version':7s} {'decisions':>9s} {'plans':>6s} {'sim ms':>8s}"
    )
    for row, versions_seen in by_trigger.items():
        for version, kinds in versions_seen.items():
            for kind, t in kinds.items():
                print(
                    f"{row:18s} {kind:18s} {version:7s} {t['decisions']:9.0f} "
                    f"{t['plans']:6.0f} {t['ms']:8.1f}"
                )
    print(
        json.dumps({"bench": "decision_cost", "ms_per_decision": results, "by_trigger": by_trigger})
    )


if __name__ == "__main__":
    main()
