"""The trainer role's contract (:class:`~dynarl.workers.trainer.Trainer`), for every
trainer backend: a resize (grow, shrink, park and resume) does not change the maths;
a saved state continues as the trainer that wrote it; the weights it sends arrive
with their version; bad input and impossible resizes are typed errors that leave it
training.

One trainer of two workers serves the module (starting processes costs seconds); its
workers are reached over the data plane, as a run reaches them."""

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import pytest_asyncio

pytest.importorskip("torch")

from dynarl.api.config import ActorConfig, AlgorithmConfig
from dynarl.control.topology import ACTOR, TO_ACTOR
from dynarl.data.router import Router
from dynarl.rl.grpo import GrpoLoss
from dynarl.testing.minibatches import random_minibatch
from dynarl.testing.workers import LocalWorkers, train_through
from dynarl.workers import backends, sync_group
from dynarl.workers.errors import TrainerError
from dynarl.workers.trainer import Minibatch, StepMetrics, Trainer
from dynarl.workers.weights import WeightManifest, WeightSyncGroup

from .conftest import MODEL, RolloutFactory

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TRAINER_BACKENDS = ["torch", "megatron"]


class Rig:
    """A started trainer and the data router its ranks take their samples from."""

    def __init__(self, trainer: Trainer, router: Router) -> None:
        self.trainer = trainer
        self.router = router
        self._steps = itertools.count()

    async def step(self, minibatch: Minibatch) -> StepMetrics:
        """One step as a run takes it: the samples through the router to the ranks."""
        name = f"s{next(self._steps)}"
        return await train_through(self.router, self.trainer, minibatch, name=name, edge=TO_ACTOR)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=TRAINER_BACKENDS)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    if request.param == "megatron":
        pytest.importorskip("megatron.core")
    actor = ActorConfig(backend=request.param, micro_batch_size=4, lr=1e-2)
    backend = backends.trainer_backend(actor)
    async with LocalWorkers(
        backend.trainer_worker_entry, ["trainer-0", "trainer-1"], consumers={TO_ACTOR: [ACTOR]}
    ) as workers:
        built = backend.build_trainer(
            model=MODEL,
            actor=actor,
            loss=GrpoLoss.from_config(AlgorithmConfig()),
            seed=0,
            workers=workers.channels,
            num_threads=1,
        )
        try:
            await built.start((0,))
            assert workers.router is not None
            yield Rig(built, workers.router)
        finally:
            await built.aclose()


async def steps(rig: Rig, first: int, plan: list[tuple[int, ...] | None]) -> list[float]:
    """One step per entry of ``plan``, resizing to it first (``None``: park, then the
    next entry resumes)."""
    trainer = rig.trainer
    losses: list[float] = []
    for members in plan:
        async with trainer.between_steps():
            if members is None:
                await trainer.park()
                assert trainer.parked and trainer.members == ()
                continue
            if members != trainer.members:
                await trainer.resize(members)
        losses.append((await rig.step(random_minibatch(first + len(losses)))).loss)
    return losses


async def test_resizing_and_parking_do_not_change_the_maths(rig: Rig, tmp_path: Path) -> None:
    trainer = rig.trainer
    start = str(tmp_path / "start.pt")
    async with trainer.between_steps():
        await trainer.resize((0,))
        await trainer.save_checkpoint(start)
    moved = await steps(rig, 0, [(0,), (0, 1), (1,), None, (1, 0), (0,)])
    async with trainer.between_steps():
        await trainer.resize((0,))
        await trainer.load_checkpoint(start)
    fixed = await steps(rig, 0, [(0,), (0,), (0,), (0,), (0,)])
    np.testing.assert_allclose(moved, fixed, rtol=1e-5)
    assert len(set(np.round(fixed, 6))) > 1, "every step gave the same loss: it proves nothing"


async def test_a_saved_state_continues_as_the_trainer_that_wrote_it(
    rig: Rig, tmp_path: Path
) -> None:
    trainer = rig.trainer
    path = str(tmp_path / "mid.pt")
    async with trainer.between_steps():
        await trainer.save_checkpoint(path)
    ahead = await steps(rig, 20, [trainer.members or (0,)] * 2)
    async with trainer.between_steps():
        await trainer.load_checkpoint(path)
    again = await steps(rig, 20, [trainer.members] * 2)
    np.testing.assert_allclose(again, ahead, rtol=1e-6)


async def test_bad_input_and_impossible_resizes_are_typed_errors_that_leave_it_training(
    rig: Rig,
) -> None:
    trainer = rig.trainer
    members = trainer.members
    bad = dict(random_minibatch(0))
    del bad["loss_mask"]
    with pytest.raises(TrainerError, match="loss_mask"):
        await rig.step(bad)
    for impossible in [(0, 0), (5,), ()]:
        with pytest.raises(TrainerError):
            async with trainer.between_steps():
                await trainer.resize(impossible)
        assert trainer.members == members
    assert np.isfinite((await rig.step(random_minibatch(3))).loss)


class _Receiver:
    """A rollout engine as a member of the weight-sync group (what a slot's handle
    does for a worker process)."""

    weight_sync_ranks = 1

    def __init__(self, engine: object) -> None:
        self.engine = engine

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        await self.engine.join_weight_sync(group)  # type: ignore[attr-defined]

    async def leave_weight_sync(self) -> None:
        await self.engine.leave_weight_sync()  # type: ignore[attr-defined]

    async def update_weights(self, manifest: WeightManifest) -> int:
        version: int = await self.engine.receive_weights(manifest)  # type: ignore[attr-defined]
        return version


async def test_sent_weights_arrive_with_their_version(
    rig: Rig, rollout_factory: RolloutFactory
) -> None:
    trainer = rig.trainer
    async with rollout_factory() as engine:
        member = _Receiver(engine)
        with anyio.fail_after(120):
            await sync_group.connect(trainer, [member])
            assert trainer.weight_sync_ready
            assert await sync_group.broadcast(trainer, 5, [member]) > 0
            async with anyio.create_task_group() as tg:  # leaving is collective
                tg.start_soon(member.leave_weight_sync)
                await trainer.leave_weight_sync()
        assert engine.weight_version == 5
