"""What the pipeline driver makes of an item a worker refused: a single-turn request
becomes an aborted sample (its row kept, nothing trained), a turn goes to the episode
runner (which aborts its episode), and a refused log-prob sample stops the run with a
clear error (dynarl built it: a bug, never silently dropped)."""

import msgspec
import pytest

from dynarl.control.topology import PROMPTS, TO_INFERENCE
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.placement import RoutedResult
from dynarl.rl.routed_results import split_results
from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import GenerateRequest


def _refused(edge: wire.EdgeId, payload: bytes) -> RoutedResult:
    item = wire.Item(id=ItemId("r0"), group=GroupId("g"), edge=edge, payload=payload)
    result = wire.ItemResult(item=item.id, status="refused", payload=b"prompt too long")
    return RoutedResult(item=item, result=result, instance=InstanceId("rollout-0"))


def _request(*, multi_turn: bool) -> bytes:
    return msgspec.msgpack.encode(
        GenerateRequest(request_id="r0", prompt_ids=(3, 4, 5), multi_turn=multi_turn)
    )


def test_a_refused_request_is_an_aborted_sample_with_its_prompt() -> None:
    split = split_results([_refused(PROMPTS, _request(multi_turn=False))])
    [episode] = split.responses
    assert (episode.request_id, episode.prompt_ids, episode.output_ids) == ("r0", (3, 4, 5), ())
    assert (episode.end, episode.num_turns) == ("aborted", 0)
    assert (split.turns, split.scored, split.trained, split.withdrawn) == ([], [], [], [])


def test_a_refused_turn_goes_to_the_episode_runner() -> None:
    refused = _refused(PROMPTS, _request(multi_turn=True))
    split = split_results([refused])
    assert split.responses == [] and split.turns == [refused]


def test_a_refused_logprob_sample_stops_the_run_with_the_reason() -> None:
    with pytest.raises(BadRequestError, match=r"inference refused sample r0 \(prompt too long\)"):
        split_results([_refused(TO_INFERENCE, b"")])
