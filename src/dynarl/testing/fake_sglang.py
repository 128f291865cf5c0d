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
  ``world_size``, ``group_name``, ``backend``: the server joins at ``rank_offset``),
  ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``: one broadcast
  from rank 0 per tensor, in order; waits for running requests unless
  ``abort_all_requests``; ``weight_version`` is taken on success), and
  ``/destroy_weights_update_group``: ``{"success", "message"}``, 400 on failure.
- ``GET /get_server_info`` (server args + scheduler info + ``version``),
  ``/get_model_info``, ``/get_weight_version``, ``/get_load`` (``GetLoadReqOutput``
  per data-parallel rank), ``/v1/models`` (``max_model_len``), ``/health``.

Differences: one data-parallel rank and tensor-parallel rank (``--tp`` is accepted and
reported), no radix cache (``cached_tokens`` is 0), no text tokenizer details beyond
the tiny model's, and releasing memory with running requests that were not paused is
refused (SGLang's scheduler flushes its cache, which fails then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import socket
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import msgspec
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from torch._C._distributed_c10d import PrefixStore, TCPStore

from dynarl.workers.config import ModelConfig, RolloutConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams, TokenDelta
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch.buckets import broadcast
from dynarl.workers.torch.engine import ALL_MEMORY, MemoryTag, RolloutEngine
from dynarl.workers.torch.errors import EngineError

DEFAULT_VERSION = "0.5.9"
"""The SGLang version the fake reports."""


class _Request:
    """One request the fake serves: its stream's chunks and what it generated."""

    def __init__(self, rid: str, input_ids: list[int], max_new_tokens: int, stream: bool):
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.stream = stream
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.chunks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.last_sent = 0
        self.finished = False


class FakeSGLang:
    """A fake SGLang server on ``127.0.0.1`` (``with`` it, or :meth:`start`/:meth:`stop`).

    Args:
        model: the tiny policy (random init from ``seed`` without a path).
        seed: model initialisation and default sampling seeds.
        max_running_requests, kv_capacity_tokens: the engine's limits.
        version: the SGLang version it reports.
        enable_memory_saver, enable_weights_cpu_backup: the server flags.
        incremental_streaming_output: stream only new tokens per chunk.
        port: where to listen (0: any free port).
    """

    def __init__(
        self,
        model: ModelConfig,
        *,
        seed: int = 0,
        max_running_requests: int = 16,
        kv_capacity_tokens: int = 16384,
        version: str = DEFAULT_VERSION,
        enable_memory_saver: bool = True,
        enable_weights_cpu_backup: bool = True,
        incremental_streaming_output: bool = False,
        tp: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        self.engine = RolloutEngine.from_config(
            model,
            RolloutConfig(
                max_running_requests=max_running_requests, kv_capacity_tokens=kv_capacity_tokens
            ),
            seed=seed,
        )
        self.tokenizer = load_tokenizer(model)
        self.version = version
        self.memory_saver = enable_memory_saver
        self.cpu_backup = enable_weights_cpu_backup
        self.incremental = incremental_streaming_output
        self.tp = tp
        self.weight_version = "default"
        self.num_generate_calls = 0
        self.fail_next: list[int] = []
        """Statuses to answer the next calls with instead (tests: 5xx retries)."""
        self._requests: dict[str, _Request] = {}
        self._paused = False
        self._released = False
        self._group: Any = None
        self._dying = False
        self._lock: asyncio.Lock | None = None
        self._work: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._socket = socket.socket()
        self._socket.bind((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
            )
        )
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Serve in a thread of its own; returns once it listens."""
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the fake SGLang server did not start")
            threading.Event().wait(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (open streams are closed)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    def die(self) -> None:
        """Die as a crashed server does: every open stream breaks mid-response and new
        connections are refused."""
        self._dying = True
        for request in list(self._requests.values()):
            request.chunks.put_nowait(None)
        self._server.should_exit = True
        self._server.force_exit = True

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._lock, self._work = asyncio.Lock(), asyncio.Event()
        self._resumed, self._idle = asyncio.Event(), asyncio.Event()
        self._resumed.set()
        self._idle.set()
        task = asyncio.get_running_loop().create_task(self._step_loop())
        try:
            yield
        finally:
            task.cancel()

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[Route]:
        post, get = ["POST", "PUT"], ["GET"]
        return [
            Route("/health", self._health, methods=get),
            Route("/health_generate", self._health, methods=get),
            Route("/generate", self._generate, methods=post),
            Route("/abort_request", self._abort_request, methods=["POST"]),
            Route("/pause_generation", self._pause, methods=["POST"]),
            Route("/continue_generation", self._continue, methods=["POST"]),
            Route("/release_memory_occupation", self._release, methods=["GET", "POST"]),
            Route("/resume_memory_occupation", self._resume, methods=["GET", "POST"]),
            Route("/init_weights_update_group", self._init_group, methods=["POST"]),
            Route("/update_weights_from_distributed", self._update_weights, methods=["POST"]),
            Route("/destroy_weights_update_group", self._destroy_group, methods=["POST"]),
            Route("/get_server_info", self._server_info, methods=get),
            Route("/get_model_info", self._model_info, methods=get),
            Route("/get_weight_version", self._weight_version, methods=get),
            Route("/get_load", self._load, methods=get),
            Route("/v1/models", self._models, methods=get),
            Route("/flush_cache", self._flush_cache, methods=["GET", "POST"]),
        ]

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _generate(self, http: Request) -> Response:
        self.num_generate_calls += 1
        if self.fail_next:
            return JSONResponse(
                {"error": {"message": "injected"}}, status_code=self.fail_next.pop(0)
            )
        obj = await http.json()
        stream = bool(obj.get("stream", False))
        try:
            request = await self._admit(obj)
        except ValueError as e:
            message = str(e)
            if not stream:
                return JSONResponse({"error": {"message": message}}, status_code=400)

            async def error_lines() -> AsyncIterator[bytes]:
                yield _sse({"error": {"message": message}})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(error_lines(), media_type="text/event-stream")
        if not stream:
            last: dict[str, Any] = {}
            while (chunk := await request.chunks.get()) is not None:
                last = chunk
            return JSONResponse(last)

        async def lines() -> AsyncIterator[bytes]:
            try:
                while (chunk := await request.chunks.get()) is not None:
                    yield _sse(chunk)
                    if chunk["meta_info"]["finish_reason"] is not None:
                        break
                if self._dying:
                    raise ConnectionAbortedError("the fake SGLang server died")
                yield b"data: [DONE]\n\n"
            finally:
                if not request.finished:  # the client went away: SGLang aborts it
                    await self._abort([request.rid])

        return StreamingResponse(lines(), media_type="text/event-stream")

    async def _abort_request(self, http: Request) -> Response:
        obj = await http.json()
        if obj.get("abort_all"):
            await self._abort(None)
        elif obj.get("rid"):
            await self._abort([obj["rid"]])
        return Response(status_code=200)

    async def _pause(self, http: Request) -> Response:
        body = await http.body()
        mode = json.loads(body).get("mode", "abort") if body else "abort"
        assert self._resumed is not None and self._lock is not None
        self._paused = True
        self._resumed.clear()
        if mode == "abort":
            await self._abort(None)
        elif mode == "retract":
            async with self._lock:
                self.engine.release_memory_occupation(["kv_cache"])
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, http: Request) -> Response:
        assert self._resumed is not None
        self._paused = False
        self._resumed.set()
        self._wake()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def _release(self, http: Request) -> Response:
        tags = await _tags(http)
        assert self._lock is not None
        if not self._paused and self.engine.stats().num_running:
            return JSONResponse(
                {"error": {"message": "cannot flush the cache with running requests"}},
                status_code=400,
            )
        if self.memory_saver:
            async with self._lock:
                self.engine.release_memory_occupation(tags, host_backup=self.cpu_backup)
            self._released = "weights" in tags
        return Response(status_code=200)

    async def _resume(self, http: Request) -> Response:
        tags = await _tags(http)
        assert self._lock is not None
        if self.memory_saver:
            async with self._lock:
                self.engine.resume_memory_occupation(tags)
            if "weights" in tags:
                self._released = False
        self._wake()
        return Response(status_code=200)

    async def _init_group(self, http: Request) -> Response:
        obj = await http.json()

        def join() -> Any:
            timeout = datetime.timedelta(seconds=60)
            store = TCPStore(
                obj["master_address"], int(obj["master_port"]), int(obj["world_size"]),
                is_master=False, timeout=timeout,
            )  # fmt: skip
            prefixed = PrefixStore(obj.get("group_name", "weight_update_group"), store)
            return torch.distributed.ProcessGroupGloo(
                prefixed, int(obj["rank_offset"]), int(obj["world_size"]), timeout
            )

        try:
            self._group = await asyncio.to_thread(join)
        except Exception as e:
            return JSONResponse(
                {"success": False, "message": f"Failed to init group: {e}."}, status_code=400
            )
        return JSONResponse(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def _update_weights(self, http: Request) -> Response:
        obj = await http.json()
        assert self._lock is not None and self._idle is not None
        if self._group is None:
            return JSONResponse(
                {"success": False, "message": "The weight update group is not initialized."},
                status_code=400,
            )
        if obj.get("abort_all_requests"):
            await self._abort(None)
        await self._idle.wait()  # SGLang's model_update_lock: running requests finish first

        specs = list(zip(obj["names"], obj["dtypes"], obj["shapes"], strict=True))

        def receive() -> dict[str, torch.Tensor]:
            if obj.get("load_format") == "flattened_bucket":
                # _update_bucketed_weights_from_distributed: one broadcast of the
                # tensors flattened and concatenated in order (FlattenedTensorBucket).
                parts = [torch.empty(shape, dtype=getattr(torch, dt)) for _, dt, shape in specs]
                flat = torch.cat([p.flatten() for p in parts])
                broadcast(flat, group=self._group, group_src=0)
                tensors, start = {}, 0
                for (name, _, shape), part in zip(specs, parts, strict=True):
                    tensors[name] = flat[start : start + part.numel()].reshape(shape)
                    start += part.numel()
                return tensors
            tensors = {}
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                broadcast(tensor, group=self._group, group_src=0)
                tensors[name] = tensor
            return tensors

        tensors = await asyncio.to_thread(receive)
        known = dict(self.engine.model.named_parameters())
        unknown = [n for n, t in tensors.items() if n not in known or known[n].shape != t.shape]
        if unknown:
            return JSONResponse(
                {"success": False, "message": f"Failed to update weights: unknown {unknown}."},
                status_code=400,
            )
        version = obj.get("weight_version")
        async with self._lock:
            held = self.engine.weight_version
            self.engine.load_weights(tensors, version=_int_version(version, held))
        message = "Succeeded to update parameter online."
        if version is not None:
            self.weight_version = str(version)
            message += f" Weight version updated to {version}."
        self._wake()
        return JSONResponse({"success": True, "message": message})

    async def _destroy_group(self, http: Request) -> Response:
        self._group = None
        return JSONResponse(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def _server_info(self, http: Request) -> Response:
        load = self.engine.stats()
        return JSONResponse(
            {
                "model_path": self._model_path(),
                "tp_size": self.tp,
                "dp_size": 1,
                "context_length": None,
                "enable_memory_saver": self.memory_saver,
                "enable_weights_cpu_backup": self.cpu_backup,
                "enable_priority_scheduling": True,
                "weight_version": self.weight_version,
                "max_total_num_tokens": self.engine_kv_capacity,
                "max_req_input_len": self.model.max_seq_len - 1,
                "internal_states": [{"num_running_reqs": load.num_running}],
                "version": self.version,
            }
        )

    async def _model_info(self, http: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self._model_path(),
                "tokenizer_path": self._model_path(),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _weight_version(self, http: Request) -> Response:
        return JSONResponse({"weight_version": self.weight_version})

    async def _load(self, http: Request) -> Response:
        load = self.engine.stats()
        waiting_tokens = sum(
            len(r.input_ids) + len(r.token_ids) for r in self._requests.values() if not r.token_ids
        )
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load.num_running + load.num_queued,
                    "num_waiting_reqs": load.num_queued,
                    "num_tokens": load.kv_tokens + waiting_tokens,
                }
            ]
        )

    async def _models(self, http: Request) -> Response:
        path = self._model_path()
        card = {"id": path, "object": "model", "owned_by": "sglang", "root": path}
        return JSONResponse(
            {"object": "list", "data": [{**card, "max_model_len": self.model.max_seq_len}]}
        )

    async def _flush_cache(self, http: Request) -> Response:
        return Response("Cache flushed.\n", status_code=200)

    # ------------------------------------------------------------------ the engine

    @property
    def engine_kv_capacity(self) -> int:
        """KV tokens the engine holds (``max_total_num_tokens``)."""
        return int(self.engine._scheduler.kv_capacity_tokens)

    async def _admit(self, obj: dict[str, Any]) -> _Request:
        """Validate like ``_validate_one_request`` and queue the request (after a pause
        ends, as the tokenizer manager waits on ``is_pause_cond``)."""
        assert self._resumed is not None and self._lock is not None
        input_ids = obj.get("input_ids")
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        params = obj.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        context = self.model.max_seq_len
        if len(input_ids) >= context:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context "
                f"length ({context} tokens)."
            )
        if len(input_ids) + max_new >= context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {len(input_ids) + max_new} "
                f"tokens: {len(input_ids)} tokens from the input messages and {max_new} "
                f"tokens for the completion. Please reduce the number of tokens in the "
                f"input messages or the completion to fit within the limit."
            )
        rid = str(obj.get("rid") or f"fake-{self.num_generate_calls}")
        if rid in self._requests:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        request = _Request(rid, list(input_ids), max_new, bool(obj.get("stream")))
        self._requests[rid] = request
        await self._resumed.wait()
        # Position-seeded sampling: the engine draws output token i with (seed, i), so
        # the input's tail rides as output and token k of the reply is drawn at its
        # position in the sequence, whatever part of it came as input.
        seed = params.get("sampling_seed")
        torch_request = GenerateRequest(
            request_id=rid,
            prompt_ids=tuple(input_ids[:1]),
            output_ids=tuple(input_ids[1:]),
            output_logprobs=(0.0,) * (len(input_ids) - 1),
            stream=True,
            sampling=SamplingParams(
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                max_new_tokens=len(input_ids) - 1 + max_new,
                stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                ignore_eos=bool(params.get("ignore_eos", False)),
                seed=None if seed is None else int(seed),
            ),
        )
        async with self._lock:
            try:
                self.engine.add_request(torch_request)
            except BadRequestError as e:
                del self._requests[rid]
                raise ValueError(str(e)) from e
        self._idle_changed()
        self._wake()
        return request

    async def _abort(self, rids: list[str] | None) -> None:
        assert self._lock is not None
        async with self._lock:
            self.engine.abort(rids)
        for rid in list(self._requests) if rids is None else rids:
            request = self._requests.get(rid)
            if request is not None and not request.finished:
                if request.token_ids:
                    reason = {"type": "abort", "message": "Abort by request.", "status_code": None}
                    self._emit(request, reason)
                else:
                    self._emit_waiting_abort(request)
        self._idle_changed()

    async def _step_loop(self) -> None:
        assert self._work is not None and self._lock is not None
        while True:
            if self._paused or self._released or not self.engine.num_unfinished:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                async with self._lock:
                    outputs = await asyncio.to_thread(self.engine.step)
            except EngineError:  # weights released and not backed up: no progress
                self._work.clear()
                await self._work.wait()
                continue
            touched: dict[str, str | None] = {}
            for out in outputs:
                request = self._requests.get(out.request_id)
                if request is None:
                    continue
                if isinstance(out, TokenDelta):
                    request.token_ids.extend(out.token_ids)
                    request.logprobs.extend(out.logprobs)
                    touched.setdefault(out.request_id, None)
                elif isinstance(out, Completion):
                    touched[out.request_id] = out.finish_reason
            for rid, finish in touched.items():
                request = self._requests[rid]
                if finish == "stop":
                    self._emit(request, {"type": "stop", "matched": request.token_ids[-1]})
                elif finish == "length":
                    self._emit(request, {"type": "length", "length": request.max_new_tokens})
                else:
                    self._emit(request, None)
            self._idle_changed()
            await asyncio.sleep(0)

    def _emit(self, request: _Request, finish_reason: dict[str, Any] | None) -> None:
        """Queue ``_handle_batch_output``'s chunk for ``request``."""
        entries = [[lp, t, None] for lp, t in zip(request.logprobs, request.token_ids, strict=True)]
        output_ids = request.token_ids
        if self.incremental and request.stream:
            entries = entries[request.last_sent :]
            output_ids = output_ids[request.last_sent :]
        request.last_sent = len(request.token_ids)
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(request.input_ids),
            "weight_version": self.weight_version,
            "total_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": entries,
            "completion_tokens": len(request.token_ids),
            "cached_tokens": 0,
        }
        text = self.tokenizer.decode(output_ids)
        request.chunks.put_nowait({"text": text, "output_ids": list(output_ids), "meta_info": meta})
        if finish_reason is not None:
            self._finish(request)

    def _emit_waiting_abort(self, request: _Request) -> None:
        """Queue ``_handle_abort_req``'s chunk: a request aborted before any token."""
        meta = {
            "id": request.rid,
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "input_token_logprobs": [],
            "output_token_logprobs": [],
            "completion_tokens": 0,
        }
        request.chunks.put_nowait({"text": "", "output_ids": [], "meta_info": meta})
        self._finish(request)

    def _finish(self, request: _Request) -> None:
        request.finished = True
        request.chunks.put_nowait(None)
        self._requests.pop(request.rid, None)

    def _idle_changed(self) -> None:
        assert self._idle is not None
        if self.engine.num_unfinished:
            self._idle.clear()
        else:
            self._idle.set()

    def _wake(self) -> None:
        if self._work is not None:
            self._work.set()

    def _model_path(self) -> str:
        return self.model.path or "dynarl-random-init"


async def _tags(http: Request) -> list[MemoryTag]:
    body = await http.body()
    tags = json.loads(body).get("tags") if body else None
    return [t for t in ALL_MEMORY if not tags or t in tags]


def _int_version(version: object, held: int) -> int:
    try:
        return int(str(version))
    except ValueError:
        return held


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def main(argv: list[str] | None = None) -> None:
    """Serve a fake SGLang server in the foreground, taking the flags of
    ``python -m sglang.launch_server`` that dynarl's launcher passes (others are
    ignored): ``--model-path`` (a checkpoint directory), ``--context-length``,
    ``--dtype``, ``--random-seed``, ``--max-running-requests``, ``--max-total-tokens``,
    ``--tp-size``, the memory-saver flags; and ``--dynarl-version``, the SGLang version
    it reports."""
    parser = argparse.ArgumentParser(prog="python -m dynarl.testing.fake_sglang")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--tp", "--tp-size", type=int, default=1)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--dynarl-version", default=DEFAULT_VERSION)
    args, _ = parser.parse_known_args(argv)
    model = ModelConfig(path=args.model_path)
    if args.context_length is not None:
        model = msgspec.structs.replace(model, max_seq_len=args.context_length)
    if args.dtype in ("float32", "bfloat16"):
        model = msgspec.structs.replace(model, dtype=args.dtype)
    torch.set_num_threads(1)
    server = FakeSGLang(
        model,
        seed=args.random_seed,
        max_running_requests=args.max_running_requests,
        kv_capacity_tokens=args.max_total_tokens,
        version=args.dynarl_version,
        enable_memory_saver=args.enable_memory_saver,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        incremental_streaming_output=args.incremental_streaming_output,
        tp=args.tp,
        host=args.host,
        port=args.port,
    )
    server._server.run(sockets=[server._socket])


if __name__ == "__main__":
    main()
