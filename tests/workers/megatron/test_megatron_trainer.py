"""The Megatron trainer's pool on two real worker processes: a change of tensor-
parallel size mid-run (TP 1 -> 2 -> 1) equals a fixed TP=1 run; a resize or reshard
that fails (a joiner failing mid-transfer, an impossible layout) is rolled back and
the old layout trains on; a TP=2 trainer sends its weights in the
HF layout a torch engine loads, with their version."""

import functools
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynarl.api.config import AlgorithmConfig  # noqa: E402
from dynarl.rl.grpo import GrpoLoss  # noqa: E402
from dynarl.testing.minibatches import random_minibatch  # noqa: E402
from dynarl.testing.workers import LocalWorkers  # noqa: E402
from dynarl.workers.config import ModelConfig  # noqa: E402
from dynarl.workers.errors import ReshardError  # noqa: E402
from dynarl.workers.megatron.main import megatron_trainer_main  # noqa: E402
from dynarl.workers.megatron.pool import MegatronPool  # noqa: E402
from dynarl.workers.megatron.spec import ModelSpec  # noqa: E402
from dynarl.workers.torch.trainer_commands import ReshardFault  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402
from dynarl.workers.torch.weight_sync import (  # noqa: E402
    join_weight_sync_group,
    leave_weight_sync_group,
    receive_by_manifest,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = ModelConfig(max_seq_len=64, num_layers=2)
CONFIG = TrainerConfig(micro_batch_size=4, lr=1e-2, timeout_s=90.0, reshard_timeout_s=30.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[MegatronPool]:
    async with LocalWorkers(megatron_trainer_main, ["mt-0", "mt-1"]) as workers:
        started = MegatronPool(
            CONFIG,
            workers=workers.channels,
            model_factory=ModelSpec(model=MODEL, seed=3),
            loss_fn=GrpoLoss.from_config(AlgorithmConfig()),
        )
        await started.start()
        await started.start_training([0])
        try:
            yield started
        finally:
            await started.close()


async def test_tensor_parallel_1_2_1_mid_run_equals_a_fixed_run(
    pool: MegatronPool, tmp_path: Path
) -> None:
    start = tmp_path / "start.pt"
    await pool.save_checkpoint(start)
    moved = [(await pool.train_step(random_minibatch(0))).loss]
    result = await pool.reshard([0, 1], tp=2, pp=1)
    assert result.bytes_moved > 0 and pool.members == (0, 1)
    moved += [(await pool.train_step(random_minibatch(s))).loss for s in (1, 2)]
    await pool.reshard([1], tp=1, pp=1)
    moved.append((await pool.train_step(random_minibatch(3))).loss)

    await pool.resize([0])
    await pool.load_checkpoint(start)
    fixed = [(await pool.train_step(random_minibatch(s))).loss for s in range(4)]
    np.testing.assert_allclose(moved, fixed, rtol=1e-5)
    assert len(set(np.round(fixed, 6))) > 1


async def test_a_failed_reshard_leaves_the_old_layout_training(pool: MegatronPool) -> None:
    members = pool.members
    before = (await pool.train_step(random_minibatch(7))).loss
    # a joiner failing mid-transfer of a data-parallel grow
    with pytest.raises(ReshardError, match="injected fault"):
        await pool.resize([0, 1], fault=ReshardFault(worker=1, after_buckets=1))
    assert pool.members == members
    with pytest.raises(ReshardError, match="increasing order"):
        await pool.reshard([1, 0], tp=2, pp=1)  # tensor ranks must follow world ranks
    assert pool.members == members and pool.replica_size == 1
    assert np.isfinite((await pool.train_step(random_minibatch(7))).loss)
    assert before != 0.0


async def test_a_tensor_parallel_trainer_sends_hf_weights_with_their_version(
    pool: MegatronPool, tmp_path: Path
) -> None:
    from dynarl.workers.torch.model import build_model

    await pool.reshard([0, 1], tp=2, pp=1)
    await pool.train_step(random_minibatch(11))
    saved = tmp_path / "now.pt"
    await pool.save_checkpoint(saved)
    engine = build_model(MODEL, seed=99)  # other weights: they must all be replaced
    port = await pool.open_weight_sync("127.0.0.1", 2)

    groups: list[object] = []

    def join() -> None:
        groups.append(
            join_weight_sync_group(
                host="127.0.0.1",
                port=port,
                rank=1,
                world_size=2,
                device=torch.device("cpu"),
                timeout_s=60,
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, join)
        await pool.connect_weight_sync("127.0.0.1", port, 2)
    manifest = await pool.weight_manifest(7)
    assert manifest.names == tuple(name for name, _ in engine.named_parameters())
    versions: list[int] = []

    async def engine_side() -> None:
        receive = functools.partial(receive_by_manifest, engine, manifest, group=groups[0])
        versions.append(await anyio.to_thread.run_sync(receive))

    async with anyio.create_task_group() as tg:
        tg.start_soon(engine_side)
        assert await pool.sync_weights(7) > 0
    await pool.leave_weight_sync()
    leave_weight_sync_group(groups[0])  # type: ignore[arg-type]
    assert versions == [7]
    expected = torch.load(saved, weights_only=True)["model"]
    for name, param in engine.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=0)
