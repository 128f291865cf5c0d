"""One request an SGLang engine holds: its sink, what the server streamed back so far
(tokens, log-probs, cached prefix, weight version), the ``/generate`` body that
(re)starts it, and the partial request it hands back when it is aborted."""

from typing import Literal

import anyio
import msgspec

from dynarl.workers.rollout import Completion, GenerateRequest, RequestSink
from dynarl.workers.sglang import messages as m
from dynarl.workers.sglang.errors import ProtocolMismatchError
from dynarl.workers.sglang.handshake import weight_version_of

Outcome = Literal["done", "aborted", "lost"]


class LiveRequest:
    """A request in the engine, from submission until its sink heard of it."""

    def __init__(self, request: GenerateRequest, sink: RequestSink) -> None:
        self.request = request
        self.sink = sink
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.version: int | None = request.weight_version
        self.posted = False
        self.streaming = False  # the server prefilled it (a chunk arrived)
        self.serving = False  # its task is running
        self.abort_requested = False
        self.abort_resent = False
        self.cached_tokens = 0
        self.outcome: Outcome | None = None
        self.settled = anyio.Event()

    @property
    def input_ids(self) -> list[int]:
        """Prompt + output so far: what a (re)start prefills."""
        return [*self.request.prompt_ids, *self.request.output_ids, *self.token_ids]

    def generate_input(self, *, context_len: int, priority: int | None) -> m.GenerateReqInput:
        """The streamed ``/generate`` that continues it from its output so far."""
        request, sampling = self.request, self.request.sampling
        input_ids = self.input_ids
        remaining = sampling.max_new_tokens - len(request.output_ids) - len(self.token_ids)
        # SGLang refuses input + max_new_tokens >= context length; stop at it instead.
        max_new = min(remaining, context_len - 1 - len(input_ids))
        return m.GenerateReqInput(
            input_ids=input_ids,
            sampling_params=m.SamplingParamsJSON(
                max_new_tokens=max_new,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=list(sampling.stop_token_ids) or None,
                ignore_eos=sampling.ignore_eos,
                sampling_seed=sampling.seed,
            ),
            rid=request.request_id,
            priority=priority,
        )

    def apply(self, meta: m.MetaInfo) -> int:
        """Take a chunk's new tokens, whether it lists all of them (cumulative) or the
        new ones (``--incremental-streaming-output``); returns how many were new."""
        total, entries = meta.completion_tokens, meta.output_token_logprobs
        known = len(self.token_ids)
        if len(entries) == total:
            new = entries[known:]
        elif known + len(entries) == total:
            new = entries
        elif known == total:
            new = []
        else:
            raise ProtocolMismatchError(
                f"/generate chunk of {meta.id} has {len(entries)} token log-probs for "
                f"{total} tokens after {known}; start the server without options that "
                f"change output_token_logprobs"
            )
        self.cached_tokens = meta.cached_tokens or self.cached_tokens
        if new:
            if self.version is None:
                self.version = weight_version_of(meta.weight_version)
            self.logprobs.extend(float(lp) for lp, _, _ in new)
            self.token_ids.extend(int(t) for _, t, _ in new)
        return len(new)

    def partial(self) -> GenerateRequest:
        """The request holding its output so far, to resume anywhere."""
        if not self.token_ids:
            return self.request
        return msgspec.structs.replace(
            self.request,
            output_ids=self.request.output_ids + tuple(self.token_ids),
            output_logprobs=self.request.output_logprobs + tuple(self.logprobs),
            weight_version=self.version,
        )

    def completion(self, reason: str, *, engine_version: int) -> Completion:
        """Its completion, once the server finished it for ``reason``."""
        request = self.request
        return Completion(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            output_ids=request.output_ids + tuple(self.token_ids),
            output_logprobs=request.output_logprobs + tuple(self.logprobs),
            finish_reason="stop" if reason == "stop" else "length",
            weight_version=self.version if self.version is not None else engine_version,
            cached_tokens=self.cached_tokens,
        )

    def settle(self, outcome: Outcome) -> None:
        """Record how it ended (the first outcome stays)."""
        if self.outcome is None:
            self.outcome = outcome
            self.settled.set()
