"""A slot hands back what its engine refuses as a typed refusal (the router finishes
and counts it), and one malformed sample in a batch does not take the others down."""

import pytest

pytest.importorskip("torch")

from dynarl.core.ids import EdgeId, GroupId, ItemId
from dynarl.data import wire
from dynarl.workers import backends
from dynarl.workers.config import InferenceConfig, ModelConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import LogprobRequest, LogprobResult
from dynarl.workers.item_feeds import _score_each, refused
from dynarl.workers.protocol import InferenceRole


def _item(i: int) -> wire.Item:
    return wire.Item(id=ItemId(f"s{i}"), group=GroupId("g"), edge=EdgeId("to_inference"))


async def test_a_refused_sample_leaves_the_rest_of_its_batch_scored() -> None:
    section = InferenceConfig(micro_batch_size=4)
    role = InferenceRole(model=ModelConfig(max_seq_len=64), inference=section)
    engine = backends.inference_backend(section).build_inference(role, name="t", num_threads=1)
    good = [
        LogprobRequest(item_id=f"s{i}", token_ids=(4, 5, 6, 7), response_start=2) for i in (0, 2)
    ]
    bad = LogprobRequest(item_id="s1", token_ids=(4, 5, 6), response_start=9)
    batch = [(_item(0), good[0]), (_item(1), bad), (_item(2), good[1])]
    scored = await _score_each(engine, batch)
    assert [(item.id, type(result)) for (item, _), result in scored] == [
        ("s0", LogprobResult),
        ("s1", BadRequestError),
        ("s2", LogprobResult),
    ]
    refusal = refused(ItemId("s1"), scored[1][1])  # type: ignore[arg-type]
    assert refusal.status == "refused" and b"response_start" in refusal.payload
