"""One request's state inside the rollout engine: its tokens, log-probs and status."""

import enum

import msgspec

from dynarl.workers.rollout import Completion, FinishReason, GenerateRequest


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting for admission, running (its KV is cached), finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request being served: prompt, output so far, and scheduling facts.

    It also satisfies the ``RequestInfo`` protocol of
    :mod:`dynarl.data.request_order` (``tool_calls``, ``prefix_tokens``,
    ``enqueued_s``), so a ``RequestOrder`` can rank it in the waiting queue.

    Attributes:
        request: the request as submitted (its partial output, if resumed, is copied
            into ``output_ids``/``output_logprobs``).
        seed: the sampling seed (the request's, or one the engine drew).
        enqueued_s: when it entered this engine's queue.
        output_ids, output_logprobs: generated tokens and their log-probs.
        weight_version: oldest weight version that generated any output token.
        status: waiting, running or finished.
        finish_reason: set when finished.
        prefix_tokens: tokens of its context the engine held in its prefix cache when
            it was queued (``RequestInfo``: the priority-aware order ranks longer
            first).
        cached_tokens: tokens its prefills took from the prefix cache instead of
            feeding them (the completion's ``cached_tokens``).
        resumed: it came with partial output (from an engine it was taken from) and
            has not been prefilled here yet: its first prefill is a re-prefill.
    """

    def __init__(self, request: GenerateRequest, *, seed: int, enqueued_s: float) -> None:
        self.request = request
        self.seed = seed
        self.enqueued_s = enqueued_s
        self.output_ids: list[int] = list(request.output_ids)
        self.output_logprobs: list[float] = list(request.output_logprobs)
        self.weight_version: int | None = request.weight_version
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.prefix_tokens = 0
        self.cached_tokens = 0
        self.resumed = bool(request.output_ids)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def tool_calls(self) -> int:
        """Tool calls the request has completed (``RequestInfo``)."""
        return self.request.tool_calls

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens: what its KV cache holds while it runs."""
        return len(self.request.prompt_ids) + len(self.output_ids)

    def context_ids(self) -> list[int]:
        """Prompt + output so far: what a (re-)prefill feeds the model."""
        return [*self.request.prompt_ids, *self.output_ids]

    def append(self, token_id: int, logprob: float, weight_version: int) -> None:
        """Record one generated token."""
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if self.weight_version is None:
            self.weight_version = weight_version

    def to_request(self) -> GenerateRequest:
        """The request with its partial output and seed, ready to resume on any engine."""
        sampling = msgspec.structs.replace(self.request.sampling, seed=self.seed)
        return msgspec.structs.replace(
            self.request,
            sampling=sampling,
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.output_logprobs),
            weight_version=self.weight_version,
        )

    def to_completion(self) -> Completion:
        """The finished request's output."""
        assert self.finish_reason is not None and self.weight_version is not None
        return Completion(
            request_id=self.request_id,
            prompt_ids=self.request.prompt_ids,
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.output_logprobs),
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            cached_tokens=self.cached_tokens,
        )
