"""What goes into an inference worker and what comes out: samples to score, their
log-probs, and progress figures.

Definitions only, and no torch: frozen ``msgspec.Struct``s that cross process
boundaries as msgpack unchanged (the controller's typed handles send them without
importing torch).
"""

import msgspec


class LogprobRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A sample to score: prompt + response tokens and where the response starts.

    Attributes:
        item_id: the sample's id.
        token_ids: prompt followed by response.
        response_start: index of the first response token (the prompt's length, >= 1).
    """

    item_id: str
    token_ids: tuple[int, ...]
    response_start: int


class LogprobResult(msgspec.Struct, frozen=True, kw_only=True):
    """Log-probs of one sample's response tokens.

    Attributes:
        item_id: the sample's id.
        logprobs: one per response token, under the policy (``log_softmax`` of its
            logits, divided by the worker's temperature).
        ref_logprobs: the same under the reference model, when the worker has one.
        weight_version: version of the policy weights that scored it.
    """

    item_id: str
    logprobs: tuple[float, ...]
    ref_logprobs: tuple[float, ...] | None
    weight_version: int


class InferenceProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker stands: samples scored so far and samples still waiting."""

    num_done: int
    num_pending: int
