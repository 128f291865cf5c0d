"""Workers killed at chosen points of a real run of the default job (dynamic, 4
devices): for each kill, how long until the controller heard of the death, how long
until the iteration it hit completed, and whether every sample finished each stage
exactly once; then, with ``--trainer``, how long a killed trainer rank takes to stop
the run with its error.

Prints a table and one JSON line. Wall-clock figures, measured on this machine.
"""

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL, TrainerRankLostError
from dynarl.testing.faults import FaultInjector, WorkerKill

SLOT_KILLS = [
    WorkerKill(target="rollout", point="rollout", iteration=1),
    WorkerKill(target="inference", point="scoring", iteration=2),
    WorkerKill(target="rollout", point="migration", iteration=3),
    WorkerKill(target="rollout", point="weight_sync", iteration=4),
]


def job(run_dir: Path, iterations: int) -> DynaRLConfig:
    return apply_overrides(
        DynaRLConfig(),
        [f"run.num_iterations={iterations}", "run.checkpoint_every=0", f"run.run_dir={run_dir}"],
    )


async def slot_kills(out: Path) -> dict[str, object]:
    cfg = job(out / "slots", 5)
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, list(SLOT_KILLS))
        injector.attach()
        await rl.run()
    samples = cfg.algorithm.samples_per_iteration
    counts = injector.completions()
    lost = sum(samples - len(c) for c in counts.values())
    duplicated = sum(sum(n - 1 for n in c.values()) for c in counts.values())
    rows = []
    print(f"{'target':<10} {'point':<12} {'iter':>4} {'detected s':>10} {'iter done s':>11}")
    for k in injector.kills:
        detected = None if k.detected_s is None else k.detected_s - k.time_s
        done = None if k.iteration_done_s is None else k.iteration_done_s - k.time_s
        rows.append(
            {
                "target": k.kill.target,
                "point": k.kill.point,
                "iteration": k.kill.iteration,
                "detected_s": detected,
                "iteration_done_s": done,
            }
        )
        print(
            f"{k.kill.target:<10} {k.kill.point:<12} {k.kill.iteration:>4} "
            f"{'-' if detected is None else f'{detected:.2f}':>10} "
            f"{'-' if done is None else f'{done:.2f}':>11}"
        )
    rewards = [round(s.mean_reward, 3) for s in rl.history]
    elapsed = [round(s.elapsed_s, 1) for s in rl.history]
    print(
        f"iterations {len(rl.history)}/5, samples lost {lost}, duplicated {duplicated}, "
        f"rewards {rewards}, iteration s {elapsed}"
    )
    return {"kills": rows, "lost": lost, "duplicated": duplicated, "rewards": rewards}


async def trainer_kill(out: Path) -> dict[str, object]:
    kill = WorkerKill(target="trainer", point="optimizer_step", iteration=1)
    async with DynaRL(job(out / "trainer", 3)) as rl:
        injector = FaultInjector(rl, [kill])
        injector.attach()
        try:
            await rl.run()
            stopped_s = None
        except TrainerRankLostError as error:
            stopped_s = time.monotonic() - injector.kills[0].time_s
            print(
                f"trainer rank killed mid-optimizer-step: stopped after {stopped_s:.2f} s: {error}"
            )
    return {"trainer_stopped_s": stopped_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trainer", action="store_true", help="also kill a trainer rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(slot_kills(Path(tmp)))
        if args.trainer:
            result |= asyncio.run(trainer_kill(Path(tmp)))
    print(json.dumps({"bench": "fault_kills", **result}))


if __name__ == "__main__":
    main()
