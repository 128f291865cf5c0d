"""Weights reach an SGLang server the way SGLang takes them: the server joins the
trainer's group (``/init_weights_update_group``), the engine posts each bucket's
names, dtypes and shapes (``/update_weights_from_distributed``, flattened buckets)
while the trainer's torch sender broadcasts them, and what it generates afterwards
carries the new version."""

import anyio
import httpx
import msgspec
import pytest
import torch

from dynarl.testing.fake_sglang import FakeSGLang
from dynarl.testing.ports import free_port
from dynarl.testing.sinks import RecordingSink
from dynarl.workers.errors import WeightSyncError
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.sglang.errors import ServerError
from dynarl.workers.torch import weight_sync
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.model import build_model
from dynarl.workers.weights import WeightManifest, WeightSyncGroup

from .conftest import MODEL, running


def greedy(prefix: str) -> list[GenerateRequest]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    return [
        GenerateRequest(request_id=f"{prefix}{i}", prompt_ids=(5 + i, 9, 11), sampling=sampling)
        for i in range(3)
    ]


class Sender:
    """The trainer's end of the group (rank 0), joined from a thread by :meth:`join`."""

    def __init__(self, model: torch.nn.Module, port: int, world_size: int, timeout_s: float):
        self.model, self.port, self.world_size, self.timeout_s = model, port, world_size, timeout_s
        self.group: Group | None = None

    def join(self) -> None:
        self.group = weight_sync.join_weight_sync_group(
            host="127.0.0.1",
            port=self.port,
            rank=0,
            world_size=self.world_size,
            device=next(self.model.parameters()).device,
            timeout_s=self.timeout_s,
        )

    def send(self, manifest: WeightManifest) -> int:
        assert self.group is not None, "join first"
        return weight_sync.send_by_manifest(self.model, manifest, group=self.group)


async def test_weights_arrive_in_buckets_with_their_version(fake: FakeSGLang) -> None:
    trained = build_model(MODEL, seed=1)
    manifest = weight_sync.manifest_of(trained, version=7, bucket_bytes=64 * 1024)
    assert len(manifest.buckets) > 1
    sender = Sender(trained, free_port(), world_size=2, timeout_s=30.0)
    group = WeightSyncGroup(
        host="127.0.0.1", port=sender.port, rank=1, world_size=2, timeout_s=30.0
    )

    async with running(fake, weight_sync_backend="gloo") as engine:
        sink = RecordingSink(raise_on_fail=True)
        await engine.submit(greedy("a"), sink)
        await sink.wait_for(lambda: len(sink.completions) == 3)
        before = dict(sink.completions)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, sender.join)
            await engine.join_weight_sync(group)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                anyio.to_thread.run_sync,
                lambda: sender.send(manifest),
            )
            assert await engine.receive_weights(manifest) == 7
        await engine.leave_weight_sync()
        assert engine.weight_version == 7 and fake.weight_version == "7"
        after = RecordingSink(raise_on_fail=True)
        await engine.submit(greedy("b"), after)
        await after.wait_for(lambda: len(after.completions) == 3)
    assert {c.weight_version for c in after.completions.values()} == {7}
    assert {c.weight_version for c in before.values()} == {0}
    changed = [
        rid
        for rid, c in after.completions.items()
        if c.output_logprobs != before["a" + rid[1:]].output_logprobs
    ]
    assert changed, "the server generated with the old weights"
    loaded = dict(fake.engine.model.named_parameters())
    for name, p in trained.named_parameters():
        assert loaded[name].data.equal(p.data), f"{name} differs from what was sent"


async def test_a_tensor_parallel_server_takes_a_rank_per_tp_worker() -> None:
    """A tp=2 server joins as ranks ``rank_offset`` and ``rank_offset + 1`` (SGLang's TP
    workers each receive the broadcast), so the group counts 1 + 2 ranks; a group that
    gives it one rank is refused before anything joins."""
    trained = build_model(MODEL, seed=1)
    manifest = weight_sync.manifest_of(trained, version=3, bucket_bytes=64 * 1024)
    sender = Sender(trained, free_port(), world_size=3, timeout_s=30.0)
    port = sender.port

    with FakeSGLang(MODEL, tp=2) as fake:
        async with running(fake, weight_sync_backend="gloo") as engine:
            one = WeightSyncGroup(host="127.0.0.1", port=port, rank=1, world_size=2)
            with pytest.raises(WeightSyncError, match="tp_size=2"):
                await engine.join_weight_sync(one)
            group = WeightSyncGroup(
                host="127.0.0.1", port=port, rank=1, world_size=3, num_ranks=2, timeout_s=30.0
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, sender.join)
                await engine.join_weight_sync(group)
            assert fake.group_ranks == (1, 2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    anyio.to_thread.run_sync,
                    lambda: sender.send(manifest),
                )
                assert await engine.receive_weights(manifest) == 3
            await engine.leave_weight_sync()
        loaded = dict(fake.engine.model.named_parameters())
    for name, p in trained.named_parameters():
        assert loaded[name].data.equal(p.data)


async def test_a_bucket_the_server_cannot_load_fails_the_sync_after_the_last(
    fake: FakeSGLang,
) -> None:
    """The trainer's model has a wider vocabulary than the server's: the server takes
    each bucket in and fails to load the embedding's (HTTP 400, as SGLang answers),
    and the engine posts the remaining buckets all the same, so the trainer's
    broadcast finishes instead of waiting for a receiver until the group's timeout;
    the sync then fails naming the bucket."""
    trained = build_model(msgspec.structs.replace(MODEL, tokenizer="chat"), seed=1)
    manifest = weight_sync.manifest_of(trained, version=7, bucket_bytes=16 * 1024)
    embedding = next(
        i for i, b in enumerate(manifest.buckets) if "model.embed_tokens.weight" in b.names
    )
    assert embedding < len(manifest.buckets) - 1, "a bucket follows the one that fails"
    sender = Sender(trained, free_port(), world_size=2, timeout_s=60.0)
    group = WeightSyncGroup(
        host="127.0.0.1", port=sender.port, rank=1, world_size=2, timeout_s=60.0
    )
    sent: list[int] = []

    async with running(fake, weight_sync_backend="gloo") as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, sender.join)
            await engine.join_weight_sync(group)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def send() -> None:
                    sent.append(await anyio.to_thread.run_sync(lambda: sender.send(manifest)))

                tg.start_soon(send)
                with pytest.raises(WeightSyncError, match=f"bucket {embedding} of"):
                    await engine.receive_weights(manifest)
        assert sent and sent[0] > 0  # every bucket went out
        assert engine.weight_version == 0 and fake.weight_version != "7"
        await engine.leave_weight_sync()


async def test_the_calls_that_enter_a_collective_are_made_once(fake: FakeSGLang) -> None:
    """A 5xx from ``/init_weights_update_group`` or ``/update_weights_from_distributed``
    is not retried: the server may have entered the collective, and a second attempt
    would wait for peers that are not coming. Other calls are retried as usual."""
    async with running(
        fake, weight_sync_backend="gloo", retry_backoff_s=0.01, max_retries=3
    ) as engine:
        fake.fail_paths["/init_weights_update_group"] = [503, 503]
        group = WeightSyncGroup(host="127.0.0.1", port=1, rank=1, world_size=2, timeout_s=5.0)
        with pytest.raises(ServerError, match="503"):
            await engine.join_weight_sync(group)
        assert fake.calls["/init_weights_update_group"] == 1
        fake.fail_paths["/get_load"] = [503, 503]
        before = fake.calls["/get_load"]
        await engine.client.get("/get_load", object)
        assert fake.calls["/get_load"] - before == 3


async def test_a_server_whose_group_was_abandoned_joins_the_next(fake: FakeSGLang) -> None:
    """When a member dies the controller abandons the group without leaving it (leaving
    is collective), so the server still holds a group under the sync's name, and SGLang
    refuses a second group under a name in use. The engine has the server destroy what
    it holds before it joins, so the next group forms and its sync arrives."""
    trained = build_model(MODEL, seed=1)
    manifest = weight_sync.manifest_of(trained, version=5, bucket_bytes=64 * 1024)
    async with running(fake, weight_sync_backend="gloo") as engine:
        for _ in range(2):  # the first group is left behind, as after a death
            sender = Sender(trained, free_port(), world_size=2, timeout_s=15.0)
            group = WeightSyncGroup(
                host="127.0.0.1", port=sender.port, rank=1, world_size=2, timeout_s=15.0
            )
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, sender.join)
                    await engine.join_weight_sync(group)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, lambda: sender.send(manifest))
            assert await engine.receive_weights(manifest) == 5
        await engine.leave_weight_sync()
        assert fake.calls["/init_weights_update_group"] == 2
    # The fake answers as SGLang does: a name in use, and a group it does not hold.
    async with httpx.AsyncClient(base_url=fake.url) as http:
        assert (await http.post("/destroy_weights_update_group", json={})).status_code == 400
