"""A trainer worker that dies inside a step, the way the Megatron pool tests kill one."""

import os
import signal
from typing import TYPE_CHECKING

import anyio
import pytest

from dynarl.testing.minibatches import random_minibatch
from dynarl.workers.errors import RankLostError

if TYPE_CHECKING:  # the test modules skip before importing torch and megatron-core
    from dynarl.testing.workers import LocalWorkers
    from dynarl.workers.megatron.pool import MegatronPool


async def step_meeting_a_death(
    pool: "MegatronPool", workers: "LocalWorkers", seed: int, dying: int
) -> None:
    """A step during which worker ``dying`` (of ``workers``) dies: it is stopped first
    (it never answers), the step is sent, and it is killed while the others are inside
    the step, waiting for it in a collective. The step raises :class:`RankLostError`."""
    pid = workers.handles[dying].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)

    async def kill_it_mid_step() -> None:
        await anyio.sleep(1.0)
        os.kill(pid, signal.SIGKILL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_it_mid_step)
        with pytest.raises(RankLostError):
            await pool.train_step(random_minibatch(seed))
