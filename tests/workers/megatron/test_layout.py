"""Layouts and the reshard plan of a data-parallel resize (pure logic): replicas of
``tp * pp`` workers, leaders, and a plan that moves a shard only to a worker that
does not hold it, from one source replica; which layouts survive a lost worker."""

import pytest

pytest.importorskip("torch")

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron.layout import Layout, Position
from dynarl.workers.megatron.state import Move, transfer_plan


def test_replicas_positions_and_leaders() -> None:
    layout = Layout((4, 5, 6, 7, 0, 1, 2, 3), tp=2, pp=2)
    assert layout.dp == 2
    assert layout.replicas() == [(4, 5, 6, 7), (0, 1, 2, 3)]
    assert layout.leaders() == (4, 0)
    assert layout.position(6) == Position(dp_rank=0, pp_rank=1, tp_rank=0)
    assert layout.position(3) == Position(dp_rank=1, pp_rank=1, tp_rank=1)
    assert layout.position(9) is None
    assert layout.at(1, 0, 1) == 1


def test_members_come_in_whole_replicas() -> None:
    with pytest.raises(TrainerError, match="multiple of tp"):
        Layout((0, 1, 2), tp=2, pp=1)


def test_a_grow_moves_each_shard_only_to_the_workers_that_lack_it() -> None:
    old = Layout((0, 1), tp=2, pp=1)
    new = Layout((0, 1, 2, 3), tp=2, pp=1)
    assert transfer_plan(old, new, source=0) == [
        Move(shard=(0, 0), source=0, receivers=(2,)),
        Move(shard=(0, 1), source=1, receivers=(3,)),
    ]


def test_a_shrink_moves_nothing_and_a_shift_moves_only_the_new_replica() -> None:
    assert transfer_plan(Layout((0, 1, 2, 3), 2, 1), Layout((2, 3), 2, 1), source=2) == []
    # replica (2, 3) stays and is the source; 4 and 5 join
    assert transfer_plan(Layout((0, 1, 2, 3), 2, 1), Layout((2, 3, 4, 5), 2, 1), source=2) == [
        Move(shard=(0, 0), source=2, receivers=(4,)),
        Move(shard=(0, 1), source=3, receivers=(5,)),
    ]
    # a worker that changes shard receives the one it now holds
    assert transfer_plan(Layout((0, 1), 1, 2), Layout((1, 0), 1, 2), source=0) == [
        Move(shard=(0, 0), source=0, receivers=(1,)),
        Move(shard=(1, 0), source=1, receivers=(0,)),
    ]


def test_a_plan_keeps_tp_and_pp() -> None:
    with pytest.raises(TrainerError, match="keeps tp and pp"):
        transfer_plan(Layout((0,), 1, 1), Layout((0, 1), 2, 1), source=0)
