"""Rollout and inference in real worker processes, called through typed handles over
real ZeroMQ, with weights from a real trainer process over a real gloo group.

Starting a slot costs seconds (importing torch), so the tests share two pre-launched
slots, as the library intends: each test gives them the roles it needs.
"""

import asyncio
import functools
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")

from dynarl.api.config import ModelConfig, RolloutConfig  # noqa: E402
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId  # noqa: E402
from dynarl.data import Item, Router, RouterConfig  # noqa: E402
from dynarl.data.zmq_transport import ZmqTransport  # noqa: E402
from dynarl.launch.local import LaunchConfig, LocalLauncher  # noqa: E402
from dynarl.workers import sync_group  # noqa: E402
from dynarl.workers.config import SLOT_CAPACITY  # noqa: E402
from dynarl.workers.errors import WeightManifestError, WorkerCallError  # noqa: E402
from dynarl.workers.handles import CallChannel, RolloutHandle  # noqa: E402
from dynarl.workers.inference import LogprobRequest  # noqa: E402
from dynarl.workers.protocol import DecodeProbe, InferenceRole, RolloutRole  # noqa: E402
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams  # noqa: E402
from dynarl.workers.tokenizer import build_tokenizer  # noqa: E402
from dynarl.workers.torch.engine import RolloutEngine  # noqa: E402
from dynarl.workers.torch.loss import weighted_nll  # noqa: E402
from dynarl.workers.torch.model import build_model  # noqa: E402
from dynarl.workers.torch.torch_trainer import TorchTrainer  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402
from dynarl.workers.torch.trainer_main import trainer_main  # noqa: E402
from dynarl.workers.torch.trainer_pool import TrainerPool  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.asyncio(loop_scope="module"),
]

MODEL = ModelConfig(max_seq_len=96)
ROLLOUT = RolloutConfig(max_running_requests=8)
ROLE = RolloutRole(model=MODEL, rollout=ROLLOUT, order="priority")
TOKENIZER = build_tokenizer()
PROMPTS = ["hi", "What is 7*6?", "a", "The quick brown fox", "x=1;y=2"]


def requests(max_new_tokens: int, *, prefix: str = "r") -> list[GenerateRequest]:
    """Greedy requests that run to ``max_new_tokens``."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [
        GenerateRequest(
            request_id=f"{prefix}{i}", prompt_ids=tuple(TOKENIZER.encode(p)), sampling=greedy
        )
        for i, p in enumerate(PROMPTS)
    ]


def in_process(
    reqs: list[GenerateRequest], state: dict[str, torch.Tensor] | None = None
) -> dict[str, Completion]:
    """What an engine in this process generates (on the seed-0 weights or ``state``)."""
    engine = RolloutEngine.from_config(MODEL, ROLLOUT, seed=0)
    if state is not None:
        engine.load_weights(state, version=0)
    return {c.request_id: c for c in engine.generate(reqs)}


def assert_same(got: list[Completion], expected: dict[str, Completion]) -> None:
    assert sorted(c.request_id for c in got) == sorted(expected)
    for c in got:
        want = expected[c.request_id]
        assert c.output_ids == want.output_ids, c.request_id
        np.testing.assert_allclose(c.output_logprobs, want.output_logprobs, atol=1e-4)


class Cluster:
    def __init__(self, router: Router, launcher: LocalLauncher) -> None:
        self.router = router
        self.launcher = launcher


async def run_cluster(started: "asyncio.Future[Cluster]", stop: asyncio.Event) -> None:
    """Own the router and the launcher in one task (their cancel scopes must be
    entered and left by the same task; a module fixture's teardown runs in another)."""
    tmp = Path(tempfile.mkdtemp(prefix="dyn-"))
    transport = ZmqTransport.bind(f"ipc://{tmp}/router.sock")
    # Generous liveness: this 2-core machine also runs the reference engines.
    config = RouterConfig(heartbeat_interval_s=0.5, liveness_timeout_s=30.0)
    consumers = {EdgeId("prompts"): [ComponentId("rollout")]}
    try:
        async with (
            Router(transport, consumers=consumers, config=config) as router,
            LocalLauncher(router, LaunchConfig(num_slots=2)) as launcher,
        ):
            started.set_result(Cluster(router, launcher))
            await stop.wait()
    except BaseException as e:
        if not started.done():
            started.set_exception(e)
        raise
    finally:
        await transport.aclose()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    started: asyncio.Future[Cluster] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    runner = asyncio.ensure_future(run_cluster(started, stop))
    try:
        yield await started
    finally:
        stop.set()
        await runner


async def rollout_on(cluster: Cluster, slot: int, instance: str) -> RolloutHandle:
    return await cluster.launcher.slots[slot].handle.assume_role(
        ROLE, instance=InstanceId(instance)
    )


@pytest.mark.timeout(90)  # includes launching the shared slots
async def test_generate_through_a_handle_matches_the_in_process_engine(cluster: Cluster) -> None:
    rollout = await rollout_on(cluster, 0, "rollout-0")
    reqs = requests(24)
    got = await rollout.generate(reqs)
    assert_same(got, await anyio.to_thread.run_sync(in_process, reqs))
    stats = await rollout.stats()
    assert (stats.state, stats.role, stats.instance) == ("active", "rollout", "rollout-0")
    assert stats.pid == cluster.launcher.slots[0].pid


@pytest.mark.timeout(60)
async def test_abort_returns_partial_output_that_resumes_on_another_process(
    cluster: Cluster,
) -> None:
    first = await rollout_on(cluster, 0, "rollout-0")
    second = await rollout_on(cluster, 1, "rollout-1")
    long = requests(40, prefix="long")
    short = requests(3, prefix="short")[:1]
    async with first.stream(long + short) as completions:
        async for completion in completions:
            assert completion.request_id == "short0"
            partial = await first.abort([r.request_id for r in long])
    assert {r.request_id for r in partial} == {r.request_id for r in long}
    assert all(3 <= len(r.output_ids) < 40 for r in partial), [len(r.output_ids) for r in partial]
    assert (await first.stats()).load.num_running == 0  # type: ignore[union-attr]

    resumed = await second.generate(partial)
    assert_same(resumed, await anyio.to_thread.run_sync(in_process, long))


@pytest.mark.timeout(90)
async def test_a_slot_switches_roles_without_a_new_process(cluster: Cluster) -> None:
    slot = cluster.launcher.slots[1]
    pid = slot.pid
    rollout = await slot.handle.assume_role(ROLE, instance=InstanceId("rollout-1"))
    [completion] = await rollout.generate(requests(8)[:1])

    inference = await slot.handle.assume_role(
        InferenceRole(model=MODEL), instance=InstanceId("inference-1")
    )
    with pytest.raises(WorkerCallError, match="not a rollout engine"):
        await RolloutHandle(cluster.router, InstanceId("inference-1")).generate(requests(2))
    [scored] = await inference.score(
        [
            LogprobRequest(
                item_id="s",
                token_ids=completion.prompt_ids + completion.output_ids,
                response_start=len(completion.prompt_ids),
            )
        ]
    )
    np.testing.assert_allclose(scored.logprobs, completion.output_logprobs, atol=1e-4)
    assert (await inference.stats()).role == "inference"

    back = await slot.handle.assume_role(ROLE, instance=InstanceId("rollout-1b"))
    assert_same(await back.generate(requests(8)[:1]), {completion.request_id: completion})
    assert (await back.stats()).pid == pid == slot.process.pid and slot.process.is_alive()
    assert cluster.router.instances.count(InstanceId("rollout-1b")) == 1
    assert InstanceId("inference-1") not in cluster.router.instances


@pytest.mark.timeout(90)
async def test_a_slot_measures_its_rollout_engines_decode_rate_connected_or_only_built(
    cluster: Cluster,
) -> None:
    """The decode probe a dynamic run with a tail size makes as it starts, on a slot
    connected as the engine (its loop runs) and on one that only built it (the probe
    runs the loop)."""
    rollout = await rollout_on(cluster, 0, "rollout-0")
    slot = cluster.launcher.slots[0].handle
    probe = DecodeProbe(new_tokens=4, seed=3)
    # The grid its limits allow: one request and its batch of 8, prompts of 16 tokens
    # and of the longest that leaves room for 2 x 4 new tokens in 96.
    expected = [(1, 22.0), (1, 93.0), (8, 22.0), (8, 93.0)]
    connected = await slot.measure_decode(probe)
    assert [(s.load, s.context) for s in connected] == expected
    assert all(s.engine_devices == 1 and s.throughput > 0 for s in connected)
    assert (await rollout.stats()).load.num_running == 0  # type: ignore[union-attr]

    narrow = RolloutRole(model=MODEL, rollout=RolloutConfig(max_running_requests=2))
    await slot.build_role(narrow, instance=InstanceId("rollout-0b"))  # not connected
    built = await slot.measure_decode(probe)
    assert [(s.load, s.context) for s in built] == [(1, 22.0), (1, 93.0), (2, 22.0), (2, 93.0)]
    await slot.connect_role()


@pytest.mark.timeout(60)
async def test_router_items_are_served_and_moved_with_their_partial_output(
    cluster: Cluster,
) -> None:
    """The pipeline's path: the router routes items to two engines; draining one hands
    its in-flight items back with their partial output, and the other finishes them
    exactly as an uninterrupted run would."""
    await rollout_on(cluster, 0, "rollout-0")
    other = cluster.launcher.slots[1].handle
    if other.role != "rollout":
        await other.assume_role(ROLE, instance=InstanceId("rollout-1"))
    router = cluster.router
    first = RolloutHandle(cluster.router, InstanceId("rollout-0"))
    reqs = requests(80, prefix="item")
    items = [
        Item(
            id=ItemId(r.request_id),
            group=GroupId(r.request_id),
            edge=EdgeId("prompts"),
            payload=msgspec.msgpack.encode(r),
        )
        for r in reqs
    ]
    await router.submit(items)
    with anyio.fail_after(30):
        while True:  # until rollout-0 has generated tokens for the items it holds
            load = (await first.stats()).load
            if load is not None and load.num_running > 0 and load.gen_tokens_per_s > 0:
                break
        await router.drain(InstanceId("rollout-0"))
        done = []
        while len(done) < len(items):
            done += await router.receive_batch()
    router.reactivate(InstanceId("rollout-0"))
    assert router.statistics().num_requeued > 0, "nothing was moved: the test proves nothing"
    # Each slot told the router at hello what it takes and what its engine runs at once.
    workers = router._placement.workers
    assert {(workers[i].capacity, workers[i].slots) for i in ("rollout-0", other.instance)} == {
        (SLOT_CAPACITY, ROLLOUT.max_running_requests)
    }
    assert {d.instance for d in done} == {other.instance}
    decoder = msgspec.msgpack.Decoder(Completion)
    got = [decoder.decode(d.result.payload) for d in done]
    assert_same(got, await anyio.to_thread.run_sync(in_process, reqs))


@pytest.mark.timeout(120)
async def test_completions_carry_the_version_the_trainer_synced(
    cluster: Cluster, tmp_path: Path
) -> None:
    rollout = await rollout_on(cluster, 0, "rollout-0")
    config = TrainerConfig(lr=5e-2, seed=0, timeout_s=60.0)
    factory = functools.partial(build_model, MODEL, seed=0)
    workers = await cluster.launcher.start_workers(trainer_main, ["trainer-0"], num_threads=1)
    channels = [CallChannel(cluster.router, h.name) for h in workers]
    pool = TrainerPool(config, workers=channels, model_factory=factory, loss_fn=weighted_nll)
    trainer = TorchTrainer(pool)
    try:
        await trainer.start((0,))
        rng = np.random.default_rng(0)
        batch = {
            "input_ids": rng.integers(4, 90, size=(4, 16)),
            "attention_mask": np.ones((4, 16), dtype=np.int64),
            "loss_weights": np.ones((4, 16), dtype=np.float32),
        }
        await pool.train_step(batch)  # the minibatch in the call (no router items)
        await sync_group.connect(trainer, [rollout])
        assert await sync_group.broadcast(trainer, 1, [rollout]) > 0
        await trainer.save_checkpoint(str(tmp_path / "v1.pt"))
    finally:
        await trainer.aclose()

    assert (await rollout.stats()).weight_version == 1
    reqs = requests(12)
    got = await rollout.generate(reqs)
    assert {c.weight_version for c in got} == {1}
    state = torch.load(tmp_path / "v1.pt", weights_only=True)["model"]
    trained = await anyio.to_thread.run_sync(in_process, reqs, state)
    assert_same(got, trained)
    before = await anyio.to_thread.run_sync(in_process, reqs)
    assert any(got_c.output_logprobs != before[got_c.request_id].output_logprobs for got_c in got)


@pytest.mark.timeout(120)
async def test_a_slot_switching_roles_keeps_its_place_in_the_weight_sync_group(
    cluster: Cluster,
) -> None:
    """Both of a slot's torch roles share its process's group: after a role switch the
    next broadcast reaches the new role without the group being rebuilt."""
    slot = cluster.launcher.slots[1].handle
    await rollout_on(cluster, 1, "rollout-9")
    config = TrainerConfig(seed=0, timeout_s=60.0)
    factory = functools.partial(build_model, MODEL, seed=0)
    workers = await cluster.launcher.start_workers(trainer_main, ["trainer-9"], num_threads=1)
    pool = TrainerPool(
        config,
        workers=[CallChannel(cluster.router, h.name) for h in workers],
        model_factory=factory,
        loss_fn=weighted_nll,
    )
    trainer = TorchTrainer(pool)
    try:
        await trainer.start((0,))
        await sync_group.connect(trainer, [slot])
        assert await sync_group.broadcast(trainer, 3, [slot]) > 0
        inference = await slot.assume_role(
            InferenceRole(model=MODEL), instance=InstanceId("inference-9")
        )
        assert slot.in_weight_sync, "the new role did not take the slot's place"
        assert await sync_group.broadcast(trainer, 4, [slot]) > 0  # no new group
        assert (await inference.stats()).weight_version == 4
        async with anyio.create_task_group() as tg:  # leave together (a collective)
            tg.start_soon(slot.leave_weight_sync)
            await trainer.leave_weight_sync()
    finally:
        await trainer.aclose()


@pytest.mark.timeout(120)
async def test_an_engine_whose_model_does_not_fit_fails_the_sync_at_once(
    cluster: Cluster,
) -> None:
    """The engine refuses the trainer's manifest (a vocabulary that differs, as a
    tokenizer mismatch gives) but still takes the broadcast in, so the sync fails
    with the refusal in seconds instead of leaving the trainer in the collective
    until the group's 60 s timeout; the engine keeps its weights, and the group
    serves a sync of matching weights afterwards."""
    rollout = await rollout_on(cluster, 0, "rollout-0")
    held = (await rollout.stats()).weight_version
    config = TrainerConfig(seed=0, timeout_s=60.0)
    wider = ModelConfig(max_seq_len=96, tokenizer="chat")  # a 110-row embedding
    workers = await cluster.launcher.start_workers(trainer_main, ["trainer-w"], num_threads=1)
    pool = TrainerPool(
        config,
        workers=[CallChannel(cluster.router, h.name) for h in workers],
        model_factory=functools.partial(build_model, wider, seed=0),
        loss_fn=weighted_nll,
    )
    trainer = TorchTrainer(pool)
    try:
        await trainer.start((0,))
        await sync_group.connect(trainer, [rollout])
        with anyio.fail_after(20), pytest.raises(WeightManifestError, match="embed"):
            await sync_group.broadcast(trainer, 7, [rollout])
        assert (await rollout.stats()).weight_version == held
        # The collective finished on both sides: the group is whole and the trainer
        # answers (its next call would queue behind a stuck broadcast otherwise).
        manifest = await trainer.weight_manifest(8)
        assert manifest.version == 8
        async with anyio.create_task_group() as tg:  # leave together (a collective)
            tg.start_soon(rollout.leave_weight_sync)
            await trainer.leave_weight_sync()
    finally:
        await trainer.aclose()
