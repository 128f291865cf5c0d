"""The elastic trainer's pure parts, in process: how minibatches split over ranks,
how tensors are cut into buckets, and the loss contract the equivalence rests on."""

import pytest

torch = pytest.importorskip("torch")

from dynarl.workers.config import ActorConfig  # noqa: E402
from dynarl.workers.torch.buckets import _span, allocate_bucketed, plan_buckets  # noqa: E402
from dynarl.workers.torch.loss import weighted_nll  # noqa: E402
from dynarl.workers.torch.train_batch import micro_batches, shard, shard_bounds  # noqa: E402
from dynarl.workers.torch.trainer_config import TrainerConfig  # noqa: E402


@pytest.mark.parametrize(("num", "world_size"), [(8, 1), (8, 4), (7, 3), (2, 4)])
def test_shards_cover_the_minibatch_once_in_order(num: int, world_size: int) -> None:
    bounds = [shard_bounds(num, rank, world_size) for rank in range(world_size)]
    covered = [i for start, stop in bounds for i in range(start, stop)]
    assert covered == list(range(num))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_aligned_shards_see_the_micro_batches_of_a_single_rank() -> None:
    batch = {"input_ids": torch.arange(16).reshape(8, 2)}
    single = [m["input_ids"].tolist() for m in micro_batches(batch, 2)]
    split = [
        m["input_ids"].tolist()
        for rank in range(4)
        for m in micro_batches(shard(batch, rank, 4), 2)
    ]
    assert split == single


def test_buckets_depend_only_on_sizes_and_dtypes() -> None:
    tensors = [
        torch.zeros(10),
        torch.zeros(10),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(100),
    ]
    plan = plan_buckets(tensors, bucket_bytes=100)
    assert plan == [[0, 1], [2], [3]]  # dtype change cuts; a big tensor goes alone
    assert plan_buckets([t.to("meta") for t in tensors], bucket_bytes=100) == plan


def test_bucketed_allocation_lets_collectives_run_in_place() -> None:
    specs = [((2, 3), torch.float32), ((4,), torch.float32), ((5,), torch.int64)]
    tensors = allocate_bucketed(specs, bucket_bytes=1 << 20, device=torch.device("cpu"))
    assert [tuple(t.shape) for t in tensors] == [(2, 3), (4,), (5,)]
    for bucket in plan_buckets(tensors, bucket_bytes=1 << 20):
        span = _span([tensors[i] for i in bucket])
        assert span is not None
        span.fill_(1)
    assert all(bool((t == 1).all()) for t in tensors)
    assert _span([torch.zeros(3), torch.zeros(3)]) is None  # separate storages


def test_weighted_nll_sums_over_micro_batches_to_the_whole_batch_mean() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 10, generator=generator)
    batch = {
        "input_ids": torch.randint(0, 10, (4, 6), generator=generator),
        "loss_weights": torch.rand(4, 6, generator=generator),
    }
    whole = weighted_nll(logits, batch)
    parts = [
        weighted_nll(logits[i : i + 1], {k: v[i : i + 1] for k, v in batch.items()})
        for i in range(4)
    ]
    total = sum(float(p.loss_sum) for p in parts) / sum(float(p.normaliser) for p in parts)
    assert total == pytest.approx(float(whole.loss_sum) / float(whole.normaliser), rel=1e-6)


def test_the_trainer_config_takes_the_actor_sections_optimisation_fields() -> None:
    actor = ActorConfig(micro_batch_size=3, lr=2e-4, weight_decay=0.1, grad_clip=None)
    config = TrainerConfig.of_actor(
        actor, seed=7, accelerator="cuda", devices=[4, 5], num_threads=2
    )
    assert (config.micro_batch_size, config.lr, config.weight_decay) == (3, 2e-4, 0.1)
    assert config.grad_clip is None and config.seed == 7
    assert (config.device, config.device_ids, config.num_threads) == ("cuda", (4, 5), 2)
    assert config.timeout_s == TrainerConfig().timeout_s  # transport knobs: defaults
