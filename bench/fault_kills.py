"""Workers killed (SIGKILL) at every injection point of real runs of the default job,
each beside its fault-free run: per kill, how long until the controller heard of the
death and until the iteration it hit completed, and whether every sample finished each
stage exactly once; then a table per kind (faults injected, iterations completed,
samples lost and duplicated, recovery time) and how far the rewards moved.

Scenarios (the same as tests/faults/test_worker_kills.py):

- ``slots``: a rollout slot mid-rollout, an inference slot mid-scoring, a rollout slot
  mid-migration and mid-weight-sync (dynamic, 5 iterations);
- ``trainer``: a trainer rank mid-optimizer-step (dynamic, 3 iterations);
- ``migration``: a trainer rank as a resize starts, a slot taking the inference role
  (dynamic, 2 iterations);
- ``restart``: a trainer rank mid-optimizer-step under static-disaggregated with two
  actor devices, so the crashed device is rebooted into the actor (3 iterations).

Prints the tables and one JSON line. Wall-clock figures, measured on this machine.
"""

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.testing.faults import FaultInjector, WorkerKill

SCENARIOS: dict[str, tuple[list[str], list[WorkerKill]]] = {
    "slots": (
        ["run.num_iterations=5"],
        [
            WorkerKill(target="rollout", point="rollout", iteration=1),
            WorkerKill(target="inference", point="scoring", iteration=2),
            WorkerKill(target="rollout", point="migration", iteration=0),
            WorkerKill(target="rollout", point="weight_sync", iteration=4),
        ],
    ),
    "trainer": (
        ["run.num_iterations=3"],
        [WorkerKill(target="trainer", point="optimizer_step", iteration=1, index=1)],
    ),
    "migration": (
        ["run.num_iterations=2"],
        [
            WorkerKill(target="trainer", point="reshard", iteration=0, index=1),
            WorkerKill(target="inference", point="role_switch", iteration=1),
        ],
    ),
    "restart": (
        [
            "run.num_iterations=3",
            "scheduler.mode=static-disaggregated",
            "rollout.initial_devices=1",
            "actor.initial_devices=2",
        ],
        [WorkerKill(target="trainer", point="optimizer_step", iteration=1, index=1)],
    ),
}


def job(run_dir: Path, overrides: list[str]) -> DynaRLConfig:
    return apply_overrides(
        DynaRLConfig(), ["run.checkpoint_every=0", f"run.run_dir={run_dir}", *overrides]
    )


async def run(cfg: DynaRLConfig, kills: list[WorkerKill]) -> tuple[DynaRL, FaultInjector]:
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, list(kills))
        injector.attach()
        await rl.run()
    return rl, injector


@dataclasses.dataclass
class Kill:
    scenario: str
    target: str
    point: str
    iteration: int
    detected_s: float | None  # kill -> the controller's WorkerFailed (slots only)
    recovered_s: float | None  # kill -> the iteration it hit completed

    @property
    def kind(self) -> str:
        return f"{self.target} @ {self.point}"


@dataclasses.dataclass
class Outcome:
    scenario: str
    kills: list[Kill]
    planned: int
    iterations: int
    of: int
    lost: int
    duplicated: int
    restarts: int
    max_reward_shift: float
    rewards: list[float]
    fault_free_rewards: list[float]
    migrations: list[list[str]]  # per iteration: kind:src->dst, "!" when it failed


async def scenario(name: str, out: Path) -> Outcome:
    overrides, kills = SCENARIOS[name]
    clean, _ = await run(job(out / f"{name}-clean", overrides), [])
    cfg = job(out / name, overrides)
    rl, injector = await run(cfg, kills)
    samples = cfg.algorithm.samples_per_iteration
    iterations = len(rl.history)
    counts = injector.completions()
    # Every (iteration, edge) the run has: an edge no item completed counts as all lost.
    edges = {edge for _, edge in counts}
    lost = sum(
        samples - len(counts.get((i, edge), {})) for i in range(iterations) for edge in edges
    )
    rewards = [s.mean_reward for s in rl.history]
    clean_rewards = [s.mean_reward for s in clean.history]
    return Outcome(
        scenario=name,
        kills=[
            Kill(
                scenario=name,
                target=k.kill.target,
                point=k.kill.point,
                iteration=k.kill.iteration,
                detected_s=None if k.detected_s is None else k.detected_s - k.time_s,
                recovered_s=None if k.iteration_done_s is None else k.iteration_done_s - k.time_s,
            )
            for k in injector.kills
        ],
        planned=len(kills),
        iterations=iterations,
        of=cfg.run.num_iterations,
        lost=lost,
        duplicated=sum(sum(n - 1 for n in c.values()) for c in counts.values()),
        restarts=sum(sum(s.restarts.values()) for s in rl.history),
        max_reward_shift=max(
            (abs(a - b) for a, b in zip(rewards, clean_rewards, strict=False)), default=0.0
        ),
        rewards=[round(r, 4) for r in rewards],
        fault_free_rewards=[round(r, 4) for r in clean_rewards],
        migrations=[
            [f"{m.kind}:{m.src}->{m.dst}{'' if m.ok else '!'}" for m in s.migrations]
            for s in rl.history
        ],
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(outcomes: list[Outcome]) -> None:
    kills = [k for o in outcomes for k in o.kills]
    print(f"{'scenario':<10} {'kind':<28} {'iter':>4} {'detected s':>10} {'recovered s':>11}")
    for k in kills:
        print(
            f"{k.scenario:<10} {k.kind:<28} {k.iteration:>4} "
            f"{_s(k.detected_s):>10} {_s(k.recovered_s):>11}"
        )
    print()
    print(f"{'kind':<28} {'injected':>8} {'recovered':>9} {'median s':>8} {'max s':>6}")
    for kind in dict.fromkeys(k.kind for k in kills):
        times = [k.recovered_s for k in kills if k.kind == kind and k.recovered_s is not None]
        n = sum(1 for k in kills if k.kind == kind)
        median = statistics.median(times) if times else None
        print(
            f"{kind:<28} {n:>8} {len(times):>9} {_s(median):>8} "
            f"{_s(max(times) if times else None):>6}"
        )
    print()
    print(
        f"{'scenario':<10} {'kills':>5} {'iterations':>10} {'lost':>5} {'dup':>4} "
        f"{'restarts':>8} {'reward shift':>12}"
    )
    for o in outcomes:
        print(
            f"{o.scenario:<10} {f'{len(o.kills)}/{o.planned}':>5} "
            f"{f'{o.iterations}/{o.of}':>10} {o.lost:>5} {o.duplicated:>4} "
            f"{o.restarts:>8} {o.max_reward_shift:>12.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated; default: all"
    )
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - SCENARIOS.keys())
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {sorted(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = [asyncio.run(scenario(name, Path(tmp))) for name in names]
    report(outcomes)
    scenarios = [dataclasses.asdict(o) for o in outcomes]
    print(json.dumps({"bench": "fault_kills", "scenarios": scenarios}))


if __name__ == "__main__":
    main()
