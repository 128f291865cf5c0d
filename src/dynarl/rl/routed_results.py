"""The data router's results as the pipeline reads them: decoded by edge into
responses, multi-turn turns, log-probs, trained samples and withdrawn requests (a
partial rollout's, with their partial output); a request a rollout engine refused
becomes an aborted sample that keeps its row."""

import logging
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from dynarl.control.topology import PROMPTS, TO_ACTOR, TO_INFERENCE
from dynarl.core.ids import ItemId
from dynarl.data.placement import RoutedResult
from dynarl.data.wire import Item
from dynarl.rl.episode import Episode
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import LogprobResult
from dynarl.workers.rollout import Completion, GenerateRequest

logger = logging.getLogger(__name__)

_COMPLETION = msgspec.msgpack.Decoder(Completion)
_LOGPROBS = msgspec.msgpack.Decoder(LogprobResult)
_REQUEST = msgspec.msgpack.Decoder(GenerateRequest)


class SplitResults(NamedTuple):
    """A batch of the router's results, by what they are."""

    responses: list[Episode]
    """Finished single-turn responses (a refused request as an aborted sample)."""
    turns: list[RoutedResult]
    """Multi-turn sessions whose turn ended (or was refused): for the episode runner."""
    scored: list[LogprobResult]
    """Log-probs from the inference stage."""
    trained: list[ItemId]
    """Samples back from the trainer's ranks."""
    withdrawn: list[GenerateRequest]
    """Requests a partial rollout withdrew while they ran, each holding the tokens it
    generated (see :meth:`~dynarl.data.router.Router.withdraw`)."""


def split_results(done: Sequence[RoutedResult]) -> SplitResults:
    """The router's results by edge and status, decoded."""
    out = SplitResults([], [], [], [], [])
    for d in done:
        if d.item.edge == PROMPTS:
            refused = d.refusal is not None
            if d.result.status == "tool_call" or (refused and _is_turn(d.item)):
                out.turns.append(d)  # the episode runner ends a refused turn's episode
            elif refused:
                out.responses.append(_refused_response(d))
            elif d.result.status == "aborted":
                out.withdrawn.append(_REQUEST.decode(d.result.payload))
            else:
                out.responses.append(Episode.of_completion(_COMPLETION.decode(d.result.payload)))
        elif d.item.edge == TO_INFERENCE:
            if d.refusal is not None:
                raise BadRequestError(
                    f"inference refused sample {d.item.id} ({d.refusal}); dynarl built it "
                    "from a response the rollout engine accepted, so this is a bug: please "
                    "report it with the run's log"
                )
            out.scored.append(_LOGPROBS.decode(d.result.payload))
        elif d.item.edge == TO_ACTOR:
            out.trained.append(d.item.id)
        else:
            logger.error("result of item %s on unexpected edge %s", d.item.id, d.item.edge)
    return out


def _refused_response(d: RoutedResult) -> Episode:
    """The aborted sample of a single-turn request a rollout engine refused: it keeps
    its row in the minibatch and is left out of the loss and its group's advantages."""
    request = _REQUEST.decode(d.item.payload)
    logger.error("request %s refused by %s: %s; not trained", d.item.id, d.instance, d.refusal)
    return Episode(
        request_id=str(d.item.id),
        prompt_ids=request.prompt_ids,
        output_ids=(),
        output_logprobs=(),
        num_turns=0,
        end="aborted",
    )


def _is_turn(item: Item) -> bool:
    """Whether ``item`` is a turn of a multi-turn episode."""
    return _REQUEST.decode(item.payload).multi_turn
