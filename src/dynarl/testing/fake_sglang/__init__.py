"""A fake SGLang 0.5.x server for tests: a real HTTP server on loopback (uvicorn +
starlette) speaking the endpoints dynarl's SGLang adapter uses as SGLang does, backed
by the torch reference engine over the tiny model of a ``ModelConfig``, so its tokens
and log-probs are real. Only the edge is faked: the adapter under test is real.

::

    with FakeSGLang(ModelConfig(max_seq_len=128)) as server:
        engine = connect(SGLangConfig(urls=(server.url,)), url=server.url, name="slot-0")

or as a process, the way the adapter's launcher starts SGLang: set
``rollout.sglang.launch_command=["python", "-m", "dynarl.testing.fake_sglang"]`` and the
launcher runs it with SGLang's flags (``--model-path`` a checkpoint directory, which
the launcher writes for a random-init model).

What each endpoint follows (SGLang ``python/sglang/srt/entrypoints/http_server.py``
at commit 0025436e, and ``managers/tokenizer_manager.py`` / ``managers/io_struct.py`` of
0.5.x, read for this file):

- ``POST /generate`` (``generate_request``): a streamed request answers
  ``text/event-stream`` lines ``data: {json}\\n\\n`` ending ``data: [DONE]\\n\\n``; a
  validation error inside the stream is one ``data: {"error": {"message": ...}}`` line
  (status 200), unstreamed it is ``{"error": {"message": ...}}`` with 400
  (``_create_error_response``). Each chunk is ``_handle_batch_output``'s ``out_dict``:
  ``text``, ``output_ids`` (cumulative; only the new ones with
  ``--incremental-streaming-output``) and ``meta_info`` (``id``, ``finish_reason``
  ``None`` until the end, then ``{"type": "stop", "matched": id}`` /
  ``{"type": "length", "length": n}`` / ``{"type": "abort", ...}``, ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version``, and with
  ``return_logprob`` ``output_token_logprobs`` as ``[logprob, id, null]`` triples,
  cumulative like ``add_logprob_to_meta_info`` builds them). A request aborted before
  any token gets ``_handle_abort_req``'s chunk (``"Abort in waiting queue"``).
  Validation as ``_validate_one_request``: an input at the context length, and input +
  ``max_new_tokens`` reaching it, are refused; a live duplicate rid too.
  ``sampling_params.sampling_seed`` seeds sampling per position like
  ``sampler.multinomial_with_seed`` (hash of seed and position), so a request resumed
  with prompt + partial output draws the same tokens.
- ``POST /abort_request`` (``abort_request``, ``AbortReq``: ``rid``, ``abort_all``):
  200 with an empty body; unknown rids are ignored.
- ``POST /pause_generation`` (``PauseGenerationReqInput.mode``: ``abort`` ends every
  request, ``retract`` sends running ones back to waiting with their KV freed,
  ``in_place`` freezes them; new requests wait until ``/continue_generation``), answers
  ``{"message": "Generation paused successfully.", "status": "ok"}``.
- ``/release_memory_occupation``, ``/resume_memory_occupation``
  (``ReleaseMemoryOccupationReqInput.tags``: ``None`` is every tag; a no-op without
  ``--enable-memory-saver``; released weights come back only with
  ``--enable-weights-cpu-backup``).
- ``/init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``: each TP worker joins as ``rank_offset +
  tp_rank``, ``ModelRunner.init_weights_update_group``),
  ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``: one broadcast
  from rank 0 per tensor, in order; with ``load_format="flattened_bucket"`` one
  broadcast of them flattened and concatenated, ``_update_bucketed_weights_from_
  distributed``, sgl-project/sglang#13824, 0.5.6+; waits for running requests unless
  ``abort_all_requests``; ``weight_version`` is taken on success; ``flush_cache``
  empties the prefix cache), and ``/destroy_weights_update_group``:
  ``{"success", "message"}``, 400 on failure. A group's name stays taken until its group
  is destroyed: joining another under it fails at once, as torch's
  ``_new_process_group_helper`` refuses a name in use, and destroying a group it does
  not hold fails too.
- ``GET /get_server_info`` (server args, ``max_running_requests`` the flag as given
  or ``null``; scheduler info; ``internal_states``, one per data-parallel rank, with
  ``Scheduler.get_internal_state``'s ``effective_max_running_requests_per_dp``, the
  limit the scheduler runs with; ``version``),
  ``/get_model_info``, ``/get_weight_version``, ``/get_load`` (``GetLoadReqOutput``
  per data-parallel rank), ``/v1/models`` (``max_model_len``), ``/health``.
- ``GET /metrics`` with ``--enable-metrics`` (:mod:`.metrics`): the scheduler's
  Prometheus counters dynarl reads (decode passes; forward seconds by category with
  ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1``; tokens by mode) and a few gauges.

- ``priority`` with ``--enable-priority-scheduling``: waiting requests are served
  larger first, then by arrival. ``cached_tokens``: the radix cache's prefix match,
  counted (:mod:`.prefix_cache`).

Differences: one data-parallel rank; ``--tp`` workers exist only as ranks of the
weight-sync group (one engine generates); prefixes are counted, not reused (the torch
engine recomputes them); no text tokenizer details beyond the tiny model's; and
releasing memory with running requests that were not paused is refused (SGLang's
scheduler flushes its cache, which fails then).

Modules: :mod:`.server` (HTTP endpoints, weight-sync group), :mod:`.scheduler`
(requests, generation, pause, memory), :mod:`.prefix_cache` (``cached_tokens``),
:mod:`.metrics` (``/metrics``),
``__main__`` (the command line the launcher runs).
"""

from dynarl.testing.fake_sglang.server import DEFAULT_VERSION, FakeSGLang

__all__ = ["DEFAULT_VERSION", "FakeSGLang"]
