"""The scheduling modes that move devices, on real worker processes.

Under ``static-colocated`` every device serves rollout, then inference, then the
actor, each iteration: the trainer parks (its state kept by one worker) and reshards
back onto every device, and slots switch roles and get the current weights before
they serve. Under ``dynamic`` the scheduler moves devices between the stages as it
sees fit. Either way, what is learned does not change: rollouts are seeded per
request and the trainer's maths do not depend on its data-parallel size, so the
reward curve matches ``static-disaggregated``'s.
"""

import multiprocessing
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.control.topology import INFERENCE, ROLLOUT
from dynarl.obs.metrics import IterationStats

pytestmark = pytest.mark.slow

SMALL = [
    "run.checkpoint_every=0",
    "cluster.num_devices=2",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "algorithm.num_prompts=8",
    "run.num_iterations=2",
]


async def run(
    tmp_path: Path, mode: str, *extra: str
) -> tuple[list[IterationStats], dict[str, int]]:
    cfg = apply_overrides(
        DynaRLConfig(),
        [*SMALL, f"scheduler.mode={mode}", f"run.run_dir={tmp_path / mode}", *extra],
    )
    async with DynaRL(cfg) as rl:
        if mode != "static-disaggregated":
            await assert_roles_prebuilt(rl)
        history = [s async for s in rl.iterations()]
        assert rl.controller is not None
        stats = rl.controller.statistics()
        rl.controller.graph.check()
    assert multiprocessing.active_children() == []
    return history, stats.events_rejected


async def assert_roles_prebuilt(rl: DynaRL) -> None:
    """A mode that moves devices builds, at start, the roles of every slot that starts
    without one, and parks them: the first move onto the slot resumes a role."""
    world = rl._world
    assert world is not None
    placed = {n.devices[0] for n in world.graph.components[ROLLOUT].active_instances()}
    unplaced = [d for d in world.slot_devices if d not in placed]
    assert unplaced
    last = "inference" if INFERENCE in world.graph.components else "rollout"  # built last
    for device in unplaced:
        stats = await world.slot(device).stats()
        assert (stats.role, stats.state) == (last, "released"), stats


@pytest.mark.timeout(240)
async def test_moving_devices_between_stages_does_not_change_what_is_learned(
    tmp_path: Path,
) -> None:
    # The fixed split has no inference devices: it trains on the engines' own
    # log-probs, which equal the recomputed ones up to rounding.
    reference, _ = await run(tmp_path, "static-disaggregated", "algorithm.old_logprobs=rollout")
    colocated, rejected = await run(tmp_path, "static-colocated")
    # Every iteration moved every device through rollout, inference and the actor.
    for stats in colocated:
        moves = [(m.src, m.dst) for m in stats.migrations]
        assert ("inference", "actor") in moves, moves
        assert any(dst == "rollout" for _, dst in moves), moves
        assert stats.allocation == {"rollout": 0, "inference": 0, "actor": 2}
    # No item was reported on an instance the controller had not placed yet.
    assert not {"ItemRouted", "ItemCompleted", "ItemsRequeued", "WorkerIdle"} & set(rejected), (
        rejected
    )
    assert [s.mean_reward for s in colocated] == [s.mean_reward for s in reference]
    assert [s.gen_tokens for s in colocated] == [s.gen_tokens for s in reference]
    for ours, theirs in zip(colocated, reference, strict=True):
        assert ours.loss == pytest.approx(theirs.loss, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(180)
async def test_dynamic_mode_trains_as_groups_finish_on_real_workers(tmp_path: Path) -> None:
    """Minibatches of whole groups in the order they finish: the actor steps while the
    rollout tail runs, and the scheduler moves devices meanwhile."""
    history, rejected = await run(tmp_path, "dynamic", "algorithm.minibatch_order=completion")
    assert [s.iteration for s in history] == [0, 1]
    assert all(s.gen_tokens > 0 and s.mean_reward >= 0 for s in history)
    assert all(s.stage_s["train"] > 0 and s.grad_norm > 0 for s in history)
    assert any(s.migrations for s in history)
    # The torch engines count their steps; the metrics hold each iteration's.
    for s in history:
        assert s.engine_steps["prefill_steps"] >= 1 and s.engine_steps["decode_steps"] >= 1
        assert s.engine_steps["decode_s"] > 0
    assert not {"ItemRouted", "ItemCompleted", "ItemsRequeued", "WorkerIdle"} & set(rejected), (
        rejected
    )
