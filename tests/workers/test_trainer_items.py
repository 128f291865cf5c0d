"""A minibatch as the data router's items: each rank gets exactly the rows it would
have cut from the whole minibatch, in order, with every field's shape."""

import numpy as np
import pytest

from dynarl.core.ids import EdgeId, GroupId, InstanceId, ItemId
from dynarl.workers.trainer_items import from_array, shard_bounds, shard_items, stack_rows


@pytest.mark.parametrize(("num", "ranks"), [(7, 3), (4, 4), (2, 3), (5, 1)])
def test_each_rank_gets_its_contiguous_rows_with_their_shapes(num: int, ranks: int) -> None:
    rng = np.random.default_rng(0)
    minibatch = {
        "input_ids": rng.integers(0, 50, size=(num, 6)),
        "loss_mask": rng.random((num, 6)).astype(np.float32),
        "advantages": rng.standard_normal(num).astype(np.float32),  # one value per sample
    }
    ids = [ItemId(f"s{i}") for i in range(num)]
    instances = [InstanceId(f"trainer-{r}") for r in range(ranks)]
    items, shards = shard_items(
        minibatch, ids, [GroupId("g")] * num, instances, edge=EdgeId("to_actor")
    )
    assert [i.id for i in items] == ids
    for rank, shard in enumerate(shards):
        start, stop = shard_bounds(num, rank, ranks)
        assert list(shard) == ids[start:stop]
        mine = [i for i in items if i.id in shard]
        assert {(i.affinity, i.instance) for i in mine} <= {("must", instances[rank])}
        stacked = stack_rows([i.payload for i in mine])
        if start == stop:
            assert stacked == {}
            continue
        for name, whole in minibatch.items():
            np.testing.assert_array_equal(from_array(stacked[name]), whole[start:stop])
