"""The rollout role: what goes into a rollout engine and what comes out (requests,
sampling parameters, streamed tokens, completions, load figures) and the
:class:`RolloutEngine` protocol every rollout backend implements.

Definitions only, and no torch: these are frozen ``msgspec.Struct``s so they cross
process boundaries as msgpack unchanged, and the SGLang backend speaks the same types
(``SamplingParams`` maps onto SGLang's ``sampling_params``, ``priority`` onto its
per-request priority, ``weight_version`` onto its ``weight_version``).

A request aborted on one engine comes back as a :class:`GenerateRequest` holding its
partial output (``output_ids``, ``output_logprobs``, the ``seed`` it was sampled with);
submitted to any engine, it re-prefills prompt + partial output and continues.
"""

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec

from dynarl.workers.weights import WeightReceiver

FinishReason = Literal["stop", "length"]
"""Why a request finished: it sampled a stop token (``stop``), or it reached its
``max_new_tokens`` or the model's maximum sequence length (``length``)."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request's tokens.

    Attributes:
        temperature: softmax temperature; ``0`` is greedy decoding (argmax).
        top_p: nucleus sampling: sample among the most likely tokens whose probabilities
            sum to at least ``top_p``.
        max_new_tokens: most tokens to generate (counting tokens generated before an
            abort, so a resumed request stops where an uninterrupted one would).
        stop_token_ids: tokens that end the request (kept in the output).
        ignore_eos: do not stop on the tokenizer's end-of-sequence token.
        seed: seed of this request's sampling randomness; the engine draws one when
            unset. A token's randomness depends only on the seed and the token's index
            in the output, so results do not depend on batch composition or on where
            the request ran.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request, fresh or resumed with its partial output.

    Attributes:
        request_id: unique among the requests an engine holds.
        prompt_ids: the prompt's token ids.
        sampling: sampling parameters.
        priority: passed to engines with priority scheduling (SGLang: larger first;
            when 0 and the role's order is ``priority``, the SGLang engine sends
            ``tool_calls``); the reference engine orders its queue with a
            ``RequestOrder`` instead.
        tool_calls: tool calls this multi-turn request has completed (for the order).
        stream: emit a :class:`TokenDelta` for every generated token, not only the
            final :class:`Completion`.
        output_ids: tokens already generated (by an engine the request was aborted
            from); empty for a fresh request.
        output_logprobs: log-probs of ``output_ids``, one each.
        weight_version: oldest weight version that generated any of ``output_ids``
            (``None`` while there are none).
        multi_turn: a turn of a multi-turn episode: when it finishes, its item goes
            back to its environment as a session (status ``tool_call``) that returns
            for its next turn, instead of completing.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    tool_calls: int = 0
    stream: bool = False
    multi_turn: bool = False
    output_ids: tuple[int, ...] = ()
    output_logprobs: tuple[float, ...] = ()
    weight_version: int | None = None


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Tokens a streaming request generated in one engine step, with their log-probs."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class Completion(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A finished request: its whole output, including any generated before an abort.

    Attributes:
        request_id: the request's id.
        prompt_ids: the prompt.
        output_ids: generated tokens (the stop token, when there is one, is the last).
        output_logprobs: log-prob of each output token under the model's own
            distribution (``log_softmax`` of the logits: temperature 1, no top-p
            truncation), i.e. what a teacher-forced forward over prompt + output gives.
        finish_reason: why it finished.
        weight_version: oldest weight version that generated any of its tokens; equal
            to the engine's version unless the request straddled a weight update.
        cached_tokens: tokens of its input the engine found in its prefix cache
            (SGLang's ``meta_info.cached_tokens``; the reference engine's per-session
            prefix cache reuses a multi-turn session's previous turn). For a
            multi-turn session it is the data router's ``prefix_tokens``, which the
            priority-aware queue ranks by.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int
    cached_tokens: int = 0


StepOutput = TokenDelta | Completion
"""What an engine step reports for one request."""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's load, the numbers of the control plane's ``EngineStats`` event.

    Attributes:
        kv_usage: KV-cache tokens held by running requests / the engine's capacity.
        num_running: requests being decoded.
        num_queued: requests waiting to be admitted (including preempted ones).
        gen_tokens_per_s: tokens generated per second of wall time over the last few
            seconds of steps (0 when there were none): the control plane integrates
            it over the time between reports to advance each running request.
        kv_tokens: KV-cache tokens held by running requests.
        cached_prefix_tokens: KV-cache tokens held for sessions between their turns
            (prefix cache; evicted first when running requests need room).
        prefix_hit_tokens: prefill tokens saved by prefix-cache hits since the engine
            started.
        prefill_tokens: tokens fed by prefills since the engine started (hits are not
            fed, so hit rate = hits / (hits + prefill)).
        prefill_steps, decode_steps: the engine's steps since it started, by kind (a
            prefill step admits requests, a decode step advances every running one by
            a token); 0 where the engine does not count them (an SGLang engine counts
            decode steps where its server keeps step counters, prefill steps never).
        prefill_s, decode_s: seconds those steps took, in all.
        resume_prefill_s: of ``prefill_s``, the seconds spent re-prefilling requests
            that came with partial output (moved here from another engine): a move's
            cost, which the control plane keeps out of the workload's prefill model.
        decode_tokens: tokens the decode steps generated, in all (each step one per
            running request: over a window, its tokens per step are the batch it ran).
    """

    kv_usage: float
    num_running: int
    num_queued: int
    gen_tokens_per_s: float
    kv_tokens: int = 0
    cached_prefix_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    resume_prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0


# ------------------------------------------------------------------ the role


class RequestSink(Protocol):
    """Where one request's outcome goes (a streamed call, a routed item)."""

    def done(self, completion: Completion) -> None:
        """The request finished."""
        ...

    def aborted(self, request: GenerateRequest) -> None:
        """The request was taken out with its partial output."""
        ...

    async def flush(self) -> None:
        """Send what :meth:`done` and :meth:`aborted` buffered."""
        ...

    async def fail(self, error: Exception) -> None:
        """The engine failed for good; the request's outcome is lost here (the sink
        hands the request back as it came, where it can)."""
        ...


class RolloutEngine(WeightReceiver, Protocol):
    """A rollout engine, as the process that hosts it drives it: the contract every
    rollout backend implements (the torch reference engine, the SGLang adapter).

    Requests are submitted with a sink that hears of each one's outcome: its
    :class:`Completion` (tokens, per-token log-probs, finish reason, weight version),
    or, if it is aborted, the request itself holding its partial output, which any
    engine resumes without losing or repeating a token. :meth:`run` serves until
    cancelled.
    """

    @property
    def max_running_requests(self) -> int:
        """Requests it runs at once (its batch; the others it holds wait in its queue):
        what its slot tells the data router at hello. The configured
        ``rollout.max_running_requests``, or the limit the engine really runs with where
        it knows better (an SGLang server reports its own)."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests in the engine (waiting or running)."""
        ...

    @property
    def error(self) -> Exception | None:
        """Why the engine stopped serving for good (``None`` while it serves)."""
        ...

    async def run(self) -> None:
        """Generate until cancelled, handing each outcome to its request's sink. If
        the engine fails, every sink fails, :attr:`error` is set and this returns."""
        ...

    async def submit(self, requests: Sequence[GenerateRequest], sink: RequestSink) -> None:
        """Queue ``requests`` (fresh, or resumed with partial output); their outcomes
        go to ``sink``. All or none are queued: a duplicate id or a bad request raises
        :class:`~dynarl.workers.errors.BadRequestError` and queues none."""
        ...

    async def abort(self, request_ids: Sequence[str] | None) -> list[GenerateRequest]:
        """Take requests out (all when ``None``; unknown ids are ignored); each sink
        hears of its own, and the requests are returned with their partial output."""
        ...

    async def end_sessions(self, session_ids: Sequence[str]) -> None:
        """These multi-turn sessions (request ids) are over: drop what the engine keeps
        for them between turns (a per-session cached prefix). Unknown ids are ignored;
        an engine that keeps nothing per session does nothing."""
        ...

    def load(self) -> EngineLoad:
        """KV tokens held, requests running and waiting, recent throughput."""
        ...

    async def release_memory(self, *, host_backup: bool) -> None:
        """Free the device memory (weights and KV cache); requests stay queued and no
        step runs until :meth:`resume_memory`. Without ``host_backup`` the weights must
        be received again after resuming."""
        ...

    async def resume_memory(self) -> None:
        """Allocate the released memory again and go on serving."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside its process (an SGLang server it
        launched is stopped); the slot calls it once, when it stops. Idempotent."""
        ...
