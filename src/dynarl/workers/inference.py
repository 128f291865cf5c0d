"""The inference role: what goes into an inference worker and what comes out (samples
to score, their log-probs, progress figures) and the :class:`InferenceEngine` protocol
every inference backend implements.

Definitions only, and no torch: frozen ``msgspec.Struct``s that cross process
boundaries as msgpack unchanged (the controller's typed handles send them without
importing torch).
"""

from collections.abc import Sequence
from typing import Protocol

import msgspec

from dynarl.workers.weights import WeightReceiver


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


class InferenceEngine(WeightReceiver, Protocol):
    """An inference worker, as the process that hosts it drives it: the contract every
    inference backend implements. It scores finished samples under the current policy
    (and a frozen reference, when configured), in order."""

    async def score(self, requests: Sequence[LogprobRequest]) -> list[LogprobResult]:
        """Log-probs of each sample's response tokens, in order. A malformed sample
        raises :class:`~dynarl.workers.errors.BadRequestError` and none is scored."""
        ...

    def progress(self) -> InferenceProgress:
        """Samples scored so far and samples waiting."""
        ...

    async def release_memory(self) -> None:
        """Free the device memory, keeping a host copy of the weights."""
        ...

    async def resume_memory(self) -> None:
        """Allocate the released memory again."""
        ...
