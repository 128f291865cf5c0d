"""Checks shared by the tests that kill a trainer rank in a real run: the dead worker
came back as a new process and the actor grew back onto it; every sample of every
iteration was trained exactly once."""

from dynarl.api.facade import DynaRL
from dynarl.testing.faults import FaultInjector, KillRecord


def assert_rank_restarted_and_regrown(
    rl: DynaRL, injector: FaultInjector, *, ranks: int
) -> KillRecord:
    """The one kill's worker runs again as a new process and is one of ``ranks`` ranks
    again (call inside the open run); returns the kill's record."""
    world = rl._world
    assert world is not None and world.trainer is not None
    assert len(injector.kills) == 1, "no trainer rank was killed"
    record = injector.kills[0]
    restarted = next(h for h in world.trainer_workers if h.name == record.worker)
    assert restarted.pid != record.pid and restarted.alive  # a new process
    assert world.trainer.dead == frozenset()
    # The actor grew back onto the restarted worker's device.
    assert record.worker in world.trainer.rank_instances()
    assert len(world.trainer.rank_instances()) == ranks
    return record


def assert_every_sample_trained_once(
    injector: FaultInjector, iterations: int, samples_per_iteration: int
) -> None:
    """Each of the first ``iterations`` trained each of its samples exactly once."""
    completions = injector.completions()
    for iteration in range(iterations):
        counts = completions[(iteration, "to_actor")]
        assert len(counts) == samples_per_iteration, iteration  # none lost
        assert set(counts.values()) == {1}, iteration  # none twice
