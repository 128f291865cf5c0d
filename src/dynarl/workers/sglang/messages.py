"""The SGLang 0.5.x HTTP requests and responses the adapter uses: definitions only.

Field names and shapes follow SGLang's own definitions, read from its source
(``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput``, ``AbortReq``,
``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
``ReleaseMemoryOccupationReqInput``, ``ResumeMemoryOccupationReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``DestroyWeightsUpdateGroupReqInput``, ``GetLoadReqOutput``; the response bodies from
``python/sglang/srt/entrypoints/http_server.py`` and the stream chunks from
``TokenizerManager._handle_batch_output`` / ``_handle_abort_req`` in
``python/sglang/srt/managers/tokenizer_manager.py``). Only the fields dynarl sends or
reads are declared; unknown response fields are ignored, so newer servers decode.
"""

from typing import Literal

import msgspec


class SamplingParamsJSON(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``GenerateReqInput.sampling_params`` (SGLang's ``SamplingParams`` keywords).

    ``sampling_seed`` makes sampling deterministic per position (SGLang hashes the
    seed with each token's position, ``sampler.multinomial_with_seed``), so a request
    resumed elsewhere with its partial output draws what it would have drawn.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /generate`` (one request, token ids in, streamed). Every field is
    sent: SGLang's own defaults differ (``stream`` and ``return_logprob`` off)."""

    input_ids: list[int]
    sampling_params: SamplingParamsJSON
    rid: str
    return_logprob: bool = True
    stream: bool = True
    priority: int | None = None


class FinishReason(msgspec.Struct, kw_only=True):
    """``meta_info.finish_reason``: ``BaseFinishReason.to_json()`` — ``{"type": "stop",
    "matched": ...}``, ``{"type": "length", "length": n}`` or ``{"type": "abort",
    "message": ...}`` (aborts may carry ``status_code`` and ``err_type``)."""

    type: Literal["stop", "length", "abort"]
    message: str | None = None
    status_code: int | None = None


class MetaInfo(msgspec.Struct, kw_only=True):
    """``meta_info`` of a ``/generate`` chunk.

    ``output_token_logprobs`` holds ``[logprob, token_id, text]`` triples; with SGLang's
    default streaming they are cumulative (every token so far), with
    ``--incremental-streaming-output`` each chunk holds only the new ones. The adapter
    tells the two apart by ``completion_tokens`` (always the total).
    """

    id: str
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] = []


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One ``data: {...}`` line of a streamed ``/generate`` response (or its one JSON
    body, unstreamed). ``error`` is set instead when the request failed validation
    inside the stream (``{"error": {"message": ...}}``, ``http_server.generate_request``)."""

    output_ids: list[int] = []
    meta_info: MetaInfo | None = None
    error: dict[str, str] | None = None


class AbortReq(msgspec.Struct, kw_only=True):
    """Body of ``POST /abort_request``: one rid, or every request."""

    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /pause_generation``: ``abort`` ends every request (their streams
    finish with an abort reason); ``retract`` moves running requests back to the
    waiting queue (their KV freed, their streams open); ``in_place`` freezes them."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryTagsReqInput(msgspec.Struct, kw_only=True):
    """Body of ``/release_memory_occupation`` and ``/resume_memory_occupation``
    (``None``: every tag)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class InitWeightsUpdateGroupReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /init_weights_update_group``: the server's ranks join a
    torch.distributed group at ``master_address:master_port`` as ranks
    ``rank_offset..rank_offset + tp - 1`` of ``world_size``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /update_weights_from_distributed``: the server receives one
    broadcast (from group rank 0) per named tensor, in order, and loads them; with
    ``load_format="flattened_bucket"`` one broadcast of them all, flattened and
    concatenated in order (``_update_bucketed_weights_from_distributed``, SGLang
    0.5.6+)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


class SuccessResponse(msgspec.Struct, kw_only=True):
    """``{"success": ..., "message": ...}`` of the weight endpoints (400 on failure)."""

    success: bool
    message: str = ""


class InternalState(msgspec.Struct, kw_only=True):
    """One data-parallel rank's entry of ``/get_server_info``'s ``internal_states``
    (``Scheduler.get_internal_state`` in ``python/sglang/srt/managers/scheduler.py``).

    ``effective_max_running_requests_per_dp`` is the scheduler's own
    ``max_running_requests``: the limit it runs with once it has sized its memory pools
    (``--max-running-requests`` divided among the data-parallel ranks and capped by
    the KV pool and any state cache; chosen from the pool when the flag is unset).
    ``None`` from servers whose scheduler does not report it.
    """

    effective_max_running_requests_per_dp: int | None = None


class ServerInfo(msgspec.Struct, kw_only=True):
    """What the adapter reads from ``GET /get_server_info``: ``http_server.get_server_info``
    answers ``dataclasses.asdict(server_args)``, the scheduler's start-up info
    (``max_total_num_tokens``, ``max_req_input_len``), ``internal_states`` (one
    :class:`InternalState` per data-parallel rank) and ``version``, spread into one
    object. ``max_running_requests`` is the ``--max-running-requests`` flag as given
    (``None``: unset), not what the scheduler runs; that is in ``internal_states``."""

    version: str
    max_total_num_tokens: int
    model_path: str | None = None
    max_req_input_len: int | None = None
    context_length: int | None = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    tp_size: int = 1
    max_running_requests: int | None = None
    internal_states: list[InternalState] = []


class ModelInfo(msgspec.Struct, kw_only=True):
    """``GET /get_model_info``."""

    model_path: str
    is_generation: bool
    weight_version: str | None = None


class WeightVersion(msgspec.Struct, kw_only=True):
    """``GET /get_weight_version``."""

    weight_version: str | None


class LoadReport(msgspec.Struct, kw_only=True):
    """One data-parallel rank of ``GET /get_load`` (``GetLoadReqOutput``):
    ``num_reqs`` counts running and waiting requests, ``num_tokens`` the KV tokens in
    use plus the waiting requests' input tokens."""

    dp_rank: int = 0
    num_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0


class ErrorResponse(msgspec.Struct, kw_only=True):
    """An error body: ``{"object": "error", "message", "type", "param", "code"}``
    (request validation, HTTP exceptions) or ``{"error": {"message": ...}}``
    (``_create_error_response``)."""

    message: str | None = None
    code: int | None = None
    error: dict[str, str] | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One model of ``GET /v1/models``: ``max_model_len`` is the context length."""

    id: str
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``."""

    data: list[ModelCard]
