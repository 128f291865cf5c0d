"""The elastic trainer with real worker processes and real gloo process groups.

Starting a worker costs seconds (importing torch and transformers), so the tests share
one pool of four pre-started workers (reached over the data plane, as a run reaches
them), as the library intends, and each test restarts
training on it: resizing does not change the maths, a failed resize leaves the old
group training, and weights reach a stand-in rollout engine with their version.
"""

import functools
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dynarl.testing.workers import LocalWorkers  # noqa: E402
from dynarl.workers.errors import ReshardError, TrainerError  # noqa: E402
from dynarl.workers.torch.loss import weighted_nll  # noqa: E402
from dynarl.workers.torch.trainer import ElasticTrainer  # noqa: E402
from dynarl.workers.torch.trainer_commands import ReshardFault  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402
from dynarl.workers.torch.trainer_main import trainer_main  # noqa: E402
from dynarl.workers.torch.trainer_pool import TrainerPool  # noqa: E402
from dynarl.workers.torch.weight_sync import (  # noqa: E402
    join_weight_sync_group,
    receive_by_manifest,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

Minibatch = dict[str, npt.NDArray[Any]]

TINY_QWEN2 = functools.partial(
    transformers.Qwen2ForCausalLM,
    transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    ),
)
"""A picklable factory of a tiny random-init Qwen2 (~23k parameters)."""

CONFIG = TrainerConfig(
    micro_batch_size=2,
    lr=1e-2,
    grad_clip=1.0,
    seed=7,
    bucket_bytes=16 * 1024,  # the tiny model's state spans many buckets
    timeout_s=60.0,
    reshard_timeout_s=3.0,
)


def minibatches(seed: int, *, num_samples: int = 8, seq_len: int = 12) -> Iterator[Minibatch]:
    """Deterministic minibatches: random tokens, right padding, random loss weights."""
    rng = np.random.default_rng(seed)
    positions = np.arange(seq_len)
    while True:
        lengths = rng.integers(seq_len // 2, seq_len + 1, size=num_samples)
        mask = (positions[None, :] < lengths[:, None]).astype(np.int64)
        yield {
            "input_ids": rng.integers(4, 64, size=(num_samples, seq_len)) * mask,
            "attention_mask": mask,
            "loss_weights": (rng.uniform(0.0, 1.0, size=mask.shape) * mask).astype(np.float32),
        }


def reference_run(batches: list[Minibatch]) -> dict[str, Any]:
    """The same steps on one rank in this process, without torch.distributed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = ElasticTrainer.build(
            TINY_QWEN2, loss_fn=weighted_nll, config=CONFIG, device=torch.device("cpu"), group=None
        )
        losses = [
            trainer.train_step({k: torch.from_numpy(v) for k, v in batch.items()}).loss
            for batch in batches
        ]
        return {"model": trainer.model.state_dict(), "losses": losses}
    finally:
        torch.set_num_threads(threads)


def relative_errors(actual: dict[str, Any], expected: dict[str, Any]) -> dict[str, float]:
    """``max|a - e| / max|e|`` of each tensor."""
    assert actual.keys() == expected.keys()
    return {
        k: float((actual[k] - expected[k]).abs().max() / expected[k].abs().max().clamp_min(1e-12))
        for k in expected
    }


def global_relative_error(actual: dict[str, Any], expected: dict[str, Any]) -> float:
    """``|a - e| / |e|`` over all tensors as one vector."""
    diff = sum(float((actual[k] - expected[k]).double().square().sum()) for k in expected)
    norm = sum(float(expected[k].double().square().sum()) for k in expected)
    return (diff / norm) ** 0.5


# The loss does not depend on an attention layer's key bias (softmax is invariant to
# adding q·b_k to every score of a query), so that bias's gradient is pure rounding
# noise, which Adam normalises into real steps: no change of summation order (a different
# data-parallel size, or thread count) reproduces it. It is held to the global bound.
NOISE_ONLY = ".self_attn.k_proj.bias"


PIDS: dict[str, int | None] = {}
"""The shared pool's worker processes, by name."""

WORKERS: list[LocalWorkers] = []
"""The shared pool's workers (to restart a dead one)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[TrainerPool]:
    names = [f"trainer-{i}" for i in range(4)]
    async with LocalWorkers(trainer_main, names) as workers:
        PIDS.update({h.name: h.pid for h in workers.handles})
        WORKERS.append(workers)
        started = TrainerPool(
            CONFIG, workers=workers.channels, model_factory=TINY_QWEN2, loss_fn=weighted_nll
        )
        await started.start()
        try:
            yield started
        finally:
            await started.close()


def load_model(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)["model"]
    return state


@pytest.mark.timeout(120)  # includes starting the shared pool
async def test_resizing_1_2_4_1_matches_a_fixed_size_run(pool: TrainerPool, tmp_path: Path) -> None:
    batches = [b for b, _ in zip(minibatches(0), range(8), strict=False)]
    # The last size-1 group is worker 2: the original rank 0 leaves on the way.
    schedule = [(0,), (0,), (0, 1), (0, 1), (0, 1, 2, 3), (0, 1, 2, 3), (2,), (2,)]
    await pool.start_training([0])
    losses = []
    for members, batch in zip(schedule, batches, strict=True):
        if members != pool.members:
            result = await pool.resize(members)
            assert result.new_members == members == pool.members
        losses.append((await pool.train_step(batch)).loss)
    await pool.save_checkpoint(tmp_path / "resized.pt")

    expected = reference_run(batches)
    actual = load_model(tmp_path / "resized.pt")
    initial = ElasticTrainer.build(
        TINY_QWEN2, loss_fn=weighted_nll, config=CONFIG, device=torch.device("cpu"), group=None
    ).model.state_dict()
    assert global_relative_error(expected["model"], initial) > 1e-2  # training moved them

    errors = relative_errors(actual, expected["model"])
    error = global_relative_error(actual, expected["model"])
    worst = max((e, k) for k, e in errors.items() if NOISE_ONLY not in k)
    print(f"\nresized vs fixed: relative error {error:.1e} overall, worst tensor {worst}")
    assert error < 1e-5
    assert worst[0] < 1e-5
    np.testing.assert_allclose(losses, expected["losses"], rtol=1e-5)


@pytest.mark.timeout(90)
async def test_a_parked_trainer_resumes_onto_any_workers_and_keeps_its_maths(
    pool: TrainerPool, tmp_path: Path
) -> None:
    """A colocated schedule parks the trainer while other stages hold every device; it
    resumes from its keeper, also onto workers of lower rank than the keeper (the
    transfer group's rank 0 is then a joiner, not the source)."""
    batches = [b for b, _ in zip(minibatches(2), range(4), strict=False)]
    await pool.start_training([2])
    losses = [(await pool.train_step(batches[0])).loss]
    parked = await pool.park()
    assert pool.parked and pool.members == () and parked.new_members == ()
    with pytest.raises(TrainerError, match="parked"):
        await pool.train_step(batches[1])
    await pool.resize([2, 0, 1])  # source 2, joiners 0 and 1 below it
    assert not pool.parked and pool.members == (2, 0, 1)
    losses.append((await pool.train_step(batches[1])).loss)
    await pool.resize([3])  # the keeper itself leaves
    await pool.park()
    await pool.resize([0, 3])
    losses += [(await pool.train_step(b)).loss for b in batches[2:]]
    await pool.save_checkpoint(tmp_path / "parked.pt")

    expected = reference_run(batches)
    actual = load_model(tmp_path / "parked.pt")
    assert global_relative_error(actual, expected["model"]) < 1e-5
    np.testing.assert_allclose(losses, expected["losses"], rtol=1e-5)


@pytest.mark.timeout(60)
async def test_a_failed_resize_leaves_the_old_group_training(
    pool: TrainerPool, tmp_path: Path
) -> None:
    batches = [b for b, _ in zip(minibatches(1), range(3), strict=False)]
    await pool.start_training([0])
    await pool.train_step(batches[0])

    # The joiner fails after the first buckets; the source times out sending the rest.
    with pytest.raises(ReshardError, match="rolled back"):
        await pool.resize([0, 1, 3], fault=ReshardFault(worker=3, after_buckets=2))
    assert pool.members == (0,)

    await pool.train_step(batches[1])  # the old group keeps training
    await pool.resize([0, 1, 3])  # and the worker that failed can still join
    await pool.train_step(batches[2])
    await pool.save_checkpoint(tmp_path / "after.pt")

    expected = reference_run(batches)
    actual = load_model(tmp_path / "after.pt")
    assert global_relative_error(actual, expected["model"]) < 1e-5


def _engine_standin(port: int, conn: Connection) -> None:
    """A rollout engine stand-in: its own copy of the model (other seed), receiving two
    weight syncs (each manifest handed over the pipe first, as the controller hands it
    to engines) and sending back each version and the received values."""
    torch.set_num_threads(1)
    torch.manual_seed(12345)
    model = TINY_QWEN2()
    group = join_weight_sync_group(
        host="127.0.0.1", port=port, rank=1, world_size=2, device=torch.device("cpu"), timeout_s=60
    )
    for _ in range(2):
        version = receive_by_manifest(model, conn.recv(), group=group)
        conn.send((version, {k: v.numpy().copy() for k, v in model.state_dict().items()}))
    conn.close()


@pytest.mark.timeout(60)
async def test_weight_sync_delivers_weights_and_version_to_an_engine(
    pool: TrainerPool, tmp_path: Path
) -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    batches = minibatches(2)
    await pool.start_training([1, 2])
    port = await pool.open_weight_sync("127.0.0.1", world_size=2)
    engine = context.Process(target=_engine_standin, args=(port, theirs), daemon=True)
    try:
        engine.start()
        theirs.close()
        await pool.connect_weight_sync("127.0.0.1", port, world_size=2)
        for version in (1, 2):
            await pool.train_step(next(batches))
            manifest = await pool.weight_manifest(version)
            assert manifest.version == version
            ours.send(manifest)
            assert await pool.sync_weights(version) > 0
            await pool.save_checkpoint(tmp_path / f"v{version}.pt")
            received_any = await anyio.to_thread.run_sync(ours.poll, 30)
            assert received_any, "the engine stand-in received nothing"
            received_version, received = ours.recv()
            assert received_version == version
            trained = load_model(tmp_path / f"v{version}.pt")
            for name, value in trained.items():
                np.testing.assert_array_equal(received[name], value.numpy(), err_msg=name)
        engine.join(timeout=10)
        assert engine.exitcode == 0
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join()
        ours.close()


@pytest.mark.timeout(60)
async def test_a_loaded_checkpoint_continues_like_the_trainer_that_wrote_it(
    pool: TrainerPool, tmp_path: Path
) -> None:
    """Model and AdamW state survive save -> load onto other (and more) members: the
    steps after it match a run that never stopped."""
    batches = [b for b, _ in zip(minibatches(3), range(4), strict=False)]
    await pool.start_training([0])
    first = [(await pool.train_step(b)).loss for b in batches[:2]]
    await pool.save_checkpoint(tmp_path / "mid.pt")
    assert not list(tmp_path.glob("*.tmp"))  # noqa: ASYNC240 (written as a temporary, renamed)

    await pool.start_training([1, 2])  # fresh weights from the seed: forgotten until loaded
    await pool.load_checkpoint(tmp_path / "mid.pt")
    rest = [(await pool.train_step(b)).loss for b in batches[2:]]
    await pool.save_checkpoint(tmp_path / "end.pt")

    expected = reference_run(batches)
    np.testing.assert_allclose(first + rest, expected["losses"], rtol=1e-5)
    assert global_relative_error(load_model(tmp_path / "end.pt"), expected["model"]) < 1e-5
    state = torch.load(tmp_path / "end.pt", weights_only=True)
    assert state["num_steps"] == 4 and state["optimizer"]["state"]  # AdamW moments saved


@pytest.mark.timeout(30)
async def test_loading_a_missing_checkpoint_says_which_file(
    pool: TrainerPool, tmp_path: Path
) -> None:
    await pool.start_training([0])
    with pytest.raises(TrainerError, match=r"cannot read the checkpoint .*missing\.pt"):
        await pool.load_checkpoint(tmp_path / "missing.pt")
    await pool.train_step(next(minibatches(4)))  # the worker keeps serving


# Last in this module: it kills one of the shared pool's workers for good.
@pytest.mark.timeout(90)
async def test_a_trainer_that_loses_a_rank_goes_on_from_the_survivors(pool: TrainerPool) -> None:
    import os
    import signal

    from dynarl.workers.errors import RankLostError

    batches = [b for b, _ in zip(minibatches(3), range(4), strict=False)]
    await pool.start_training([0, 1, 2, 3])
    losses = [(await pool.train_step(batch)).loss for batch in batches[:2]]
    pid = PIDS[pool.workers[1].name]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RankLostError):
        await pool.train_step(batches[2])  # met the dead rank: not applied anywhere
    recovery = await pool.recover()
    assert recovery.lost == (1,) and recovery.members == (0, 2, 3) == pool.members
    assert recovery.num_steps == 2 and not recovery.step_applied
    losses += [(await pool.train_step(batch)).loss for batch in batches[2:]]  # re-run
    # The survivors' steps are the steps a single rank takes on the same minibatches.
    np.testing.assert_allclose(losses, reference_run(batches)["losses"], rtol=1e-5)
    with pytest.raises(TrainerError, match="died"):
        await pool.resize([0, 1])


@pytest.mark.timeout(120)
async def test_a_worker_killed_mid_resize_leaves_the_old_group_training(pool: TrainerPool) -> None:
    """After the previous test the pool has workers 0, 2 and 3. Worker 3 dies as a
    resize that it joins starts: the survivors may be blocked with it in ``new_group``,
    are interrupted, and the resize is rolled back onto the old ranks, whose steps go
    on as a single rank's would."""
    import os
    import signal

    from dynarl.workers.errors import RankLostError

    assert pool.dead == {1}, "runs after test_a_trainer_that_loses_a_rank_goes_on..."
    batches = [b for b, _ in zip(minibatches(4), range(3), strict=False)]
    await pool.start_training([0, 2])
    losses = [(await pool.train_step(batches[0])).loss]

    def kill_the_joiner(_: object) -> None:
        pid = PIDS[pool.workers[3].name]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    pool.resize_listeners.append(kill_the_joiner)
    try:
        with pytest.raises(RankLostError):
            await pool.resize([0, 2, 3])
    finally:
        pool.resize_listeners.remove(kill_the_joiner)
    recovery = await pool.recover()
    print(f"\nkilled mid-resize: rebuilt in {recovery.elapsed_s:.2f} s")
    assert recovery.lost == (3,) and recovery.members == (0, 2) == pool.members
    assert recovery.num_steps == 1 and not recovery.step_applied
    losses += [(await pool.train_step(batch)).loss for batch in batches[1:]]
    np.testing.assert_allclose(losses, reference_run(batches)["losses"], rtol=1e-5)


@pytest.mark.timeout(180)
async def test_a_restarted_worker_that_dies_while_joining_leaves_the_survivors_training(
    pool: TrainerPool,
) -> None:
    """After the previous tests the pool trains on workers 0 and 2; 1 and 3 are dead.
    Worker 1 is started again and admitted, but its new process dies before it joins:
    the survivors, already waiting for it in the new world's rendezvous, are
    interrupted and rebuild their world without it (not after the rendezvous's
    ``timeout_s``); a second restart is admitted and becomes a rank, and the steps are
    a single rank's steps throughout."""
    import os
    import signal

    from dynarl.workers.errors import RankLostError

    assert pool.members == (0, 2) and pool.dead == {1, 3}, "runs after the tests above"
    batches = [b for b, _ in zip(minibatches(5), range(3), strict=False)]
    await pool.start_training([0, 2])
    losses = [(await pool.train_step(batches[0])).loss]

    doomed = await WORKERS[0].restart(1)
    assert doomed.pid is not None
    os.kill(doomed.pid, signal.SIGSTOP)  # says nothing more, keeps its connection

    async def kill_it_once_the_others_wait() -> None:
        await anyio.sleep(1.0)
        os.kill(doomed.pid, signal.SIGKILL)  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_it_once_the_others_wait)
        with pytest.raises(RankLostError):
            await pool.admit([1])
    # A hang guard, well inside the rendezvous timeout the survivors were waiting on.
    with anyio.fail_after(CONFIG.timeout_s / 2):
        recovery = await pool.recover()
    assert recovery.lost == (1,) and recovery.members == (0, 2) == pool.members
    losses.append((await pool.train_step(batches[1])).loss)

    await WORKERS[0].restart(1)
    await pool.admit([1])
    await pool.resize([0, 1, 2])
    assert pool.members == (0, 1, 2) and pool.dead == {3}
    losses.append((await pool.train_step(batches[2])).loss)
    np.testing.assert_allclose(losses, reference_run(batches)["losses"], rtol=1e-5)
