"""The layout a Megatron trainer continues on after a loss, and when there is none: the
survivors make whole replicas of the same tp and pp, each shard comes from a survivor
holding it at the last step every shard reached, and holders keep their positions
where they can (nothing moves for them)."""

import pytest

pytest.importorskip("megatron.core")

from dynarl.workers.config import ModelConfig
from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import recovery, state
from dynarl.workers.megatron.layout import Layout
from dynarl.workers.megatron.spec import ModelSpec

TP2 = Layout((0, 1, 2, 3), tp=2, pp=1)  # replicas (0, 1) and (2, 3)


def steps(alive: list[int], n: int = 4) -> dict[int, int]:
    return dict.fromkeys(alive, n)


def test_the_complete_replica_stays_and_the_last_survivor_is_held() -> None:
    chosen = recovery.plan(TP2, [0, 1, 3], steps([0, 1, 3]))
    assert chosen.members == (0, 1) and chosen.holders == (0, 1) and chosen.source == 0
    moves = state.transfer_plan(
        Layout(chosen.holders, 2, 1), Layout(chosen.members, 2, 1), source=0
    )
    assert moves == []  # nothing moves: the holders keep their shards


def test_a_copy_is_assembled_from_the_shards_of_two_replicas() -> None:
    # Worker 1 (tp rank 1 of replica 0) died: worker 0 and worker 3 hold both shards.
    chosen = recovery.plan(TP2, [0, 2, 3], steps([0, 2, 3]))
    assert chosen.members == (0, 3) and chosen.holders == (0, 3)


def test_a_spare_survivor_restores_two_replicas_and_shards_move_to_it() -> None:
    # Worker 4 held no rank; worker 1 died: two replicas again, (0, 2) and (3, 4).
    alive = {0: 4, 2: 4, 3: 4, 4: -1}
    chosen = recovery.plan(TP2, [0, 2, 3, 4], alive)
    assert chosen.members == (0, 2, 3, 4) and chosen.holders == (0, 3)
    moves = state.transfer_plan(
        Layout(chosen.holders, 2, 1), Layout(chosen.members, 2, 1), source=0
    )
    assert [(m.shard, m.source, m.receivers) for m in moves] == [
        ((0, 0), 0, (3,)),
        ((0, 1), 3, (2, 4)),  # worker 3 sends its shard, then takes the other
    ]


def test_the_most_steps_every_shard_reached_is_restored() -> None:
    # Replica 1 applied the interrupted step; worker 0 of the broken replica did not.
    chosen = recovery.plan(TP2, [0, 2, 3], {0: 4, 2: 5, 3: 5})
    assert chosen.holders == (2, 3)
    chosen = recovery.plan(TP2, [0, 1, 3], {0: 4, 1: 4, 3: 5})
    assert chosen.holders == (0, 1)  # shard (0, 0) reached only 4 steps


def test_a_shard_whose_every_copy_died_is_refused() -> None:
    with pytest.raises(TrainerError, match=r"every copy of model shard\(s\) \[\(0, 1\)\]"):
        recovery.plan(TP2, [0, 2], steps([0, 2]))
    spec = ModelSpec(model=ModelConfig(), tp=2)
    why = recovery.unrecoverable(spec, TP2, {1, 3})
    assert why is not None and "every copy of model shard(s) [(0, 1)]" in why
    assert recovery.unrecoverable(spec, TP2, {1}) is None
    assert recovery.unrecoverable(spec, TP2, {1, 2}) is None  # (0, 0) and (0, 1) survive


def test_one_replica_is_refused() -> None:
    spec = ModelSpec(model=ModelConfig(), tp=2)
    alone = Layout((0, 1), tp=2, pp=1)
    assert "tp=2, pp=1 cannot survive a lost worker" in (
        recovery.unrecoverable(spec, alone, ()) or ""
    )
    assert recovery.unrecoverable(spec, alone, {5}) is None  # a spare worker died


def test_pipeline_stages_follow_world_order() -> None:
    pp2 = Layout((0, 1, 2, 3, 4, 5, 6, 7), tp=2, pp=2)
    chosen = recovery.plan(pp2, [0, 1, 2, 3, 4, 6, 7], steps([0, 1, 2, 3, 4, 6, 7]))
    assert chosen.members == (0, 1, 2, 3)  # replica 0 whole; 4, 6, 7 are held
    assert chosen.holders == (0, 1, 2, 3)
    chosen = recovery.plan(pp2, [0, 2, 3, 4, 5, 6, 7], steps([0, 2, 3, 4, 5, 6, 7]))
    # Worker 1 died: each of 0, 5, 6 and 7 keeps its shard, 2, 3 and 4 are held.
    assert chosen.members == chosen.holders == (0, 5, 6, 7)
