"""The fake server's HTTP side: one starlette route per SGLang endpoint dynarl uses,
served by uvicorn on loopback in a thread of its own (or in the foreground as a
process, :mod:`.__main__`). Generation, abort, pause and memory go to the
:class:`~.scheduler.FakeScheduler`; the weight-sync group is joined here, the way
SGLang's ``init_custom_process_group`` does (a TCP store prefixed with the group's
name, gloo on CPU)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import socket
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from torch._C._distributed_c10d import PrefixStore, TCPStore

from dynarl.testing.fake_sglang.metrics import SchedulerMetrics
from dynarl.testing.fake_sglang.scheduler import FakeScheduler
from dynarl.workers.config import ModelConfig
from dynarl.workers.torch.buckets import broadcast
from dynarl.workers.torch.engine import ALL_MEMORY, MemoryTag

DEFAULT_VERSION = "0.5.9"
"""The SGLang version the fake reports."""

_GROUP_NAME = "weight_update_group"  # the requests' default group_name (io_struct)


class FakeSGLang:
    """A fake SGLang server on ``127.0.0.1`` (``with`` it, or :meth:`start`/:meth:`stop`).

    Args:
        model: the tiny policy (random init from ``seed`` without a path).
        seed: model initialisation and default sampling seeds.
        max_running_requests, kv_capacity_tokens: the engine's limits;
            ``max_running_requests`` is what it reports as its scheduler's own
            (``internal_states[0].effective_max_running_requests_per_dp``).
        requested_max_running_requests: the ``--max-running-requests`` flag it
            reports among its server args (``None``: not given, as SGLang's default).
        reports_running_limit: whether its ``internal_states`` carry its limit
            (``False``: as a server whose scheduler does not report it).
        version: the SGLang version it reports.
        enable_memory_saver, enable_weights_cpu_backup: the server flags.
        enable_priority_scheduling: serve waiting requests by ``priority``.
        incremental_streaming_output: stream only new tokens per chunk.
        enable_metrics: serve ``/metrics`` (:mod:`.metrics`).
        metrics_device_timer: report forward passes' seconds there
            (``SGLANG_ENABLE_METRICS_DEVICE_TIMER``).
        tp: the tensor-parallel size it reports; it joins weight-sync groups as that
            many ranks (``rank_offset`` onwards), as SGLang's TP workers do.
        port: where to listen (0: any free port).
    """

    def __init__(
        self,
        model: ModelConfig,
        *,
        seed: int = 0,
        max_running_requests: int = 16,
        requested_max_running_requests: int | None = None,
        reports_running_limit: bool = True,
        kv_capacity_tokens: int = 16384,
        version: str = DEFAULT_VERSION,
        enable_memory_saver: bool = True,
        enable_weights_cpu_backup: bool = True,
        enable_priority_scheduling: bool = True,
        incremental_streaming_output: bool = False,
        enable_metrics: bool = False,
        metrics_device_timer: bool = False,
        tp: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        self.scheduler = FakeScheduler(
            model,
            seed=seed,
            max_running_requests=max_running_requests,
            kv_capacity_tokens=kv_capacity_tokens,
            priority_scheduling=enable_priority_scheduling,
            incremental=incremental_streaming_output,
        )
        self.engine = self.scheduler.engine
        self.max_running_requests = max_running_requests
        self.requested_max_running_requests = requested_max_running_requests
        self.reports_running_limit = reports_running_limit
        self.version = version
        self.memory_saver = enable_memory_saver
        self.cpu_backup = enable_weights_cpu_backup
        self.tp = tp
        self.enable_metrics = enable_metrics
        self.metrics = SchedulerMetrics(
            self.engine.stats, model_name=self._model_path(), device_timer=metrics_device_timer
        )
        self.num_generate_calls = 0
        self.num_load_calls = 0
        self.fail_next: list[int] = []
        """Statuses to answer the next calls with instead (tests: 5xx retries)."""
        self.fail_paths: dict[str, list[int]] = {}
        """Per endpoint path, statuses to answer its next calls with instead."""
        self.calls: collections.Counter[str] = collections.Counter()
        """Calls received per endpoint path."""
        self.group_ranks: tuple[int, ...] = ()
        """The ranks it holds in the weight-sync group it joined last (one per TP
        worker)."""
        self._groups: dict[str, list[Any]] = {}  # per group name, a group per TP worker
        self._socket = socket.socket()
        # As uvicorn binds SGLang's port: a server started on the port of one just
        # stopped (a slot relaunching its engine) is not refused for the old one's
        # connections in TIME_WAIT.
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def weight_version(self) -> str:
        """The ``weight_version`` it reports (``"default"`` before any update)."""
        return self.scheduler.weight_version

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

    def serve_forever(self) -> None:
        """Serve in this thread until the process is signalled."""
        self._server.run(sockets=[self._socket])

    def stop(self) -> None:
        """Stop serving (open streams are closed)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    def die(self) -> None:
        """Die as a crashed server does: every open stream breaks mid-response and new
        connections are refused."""
        self.scheduler.die()
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
        task = asyncio.get_running_loop().create_task(self.scheduler.run())
        await asyncio.sleep(0)  # the scheduler's events exist before the first request
        try:
            yield
        finally:
            task.cancel()

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[Route]:
        return [
            Route(r.path, self._counted(r.path, r.endpoint), methods=r.methods)
            for r in self._endpoints()
        ]

    def _counted(self, path: str, endpoint: Any) -> Any:
        """``endpoint``, counted in :attr:`calls` and failing as :attr:`fail_paths` says."""

        async def call(request: Request) -> Response:
            self.calls[path] += 1
            failing = self.fail_paths.get(path)
            if failing:
                return JSONResponse({"error": {"message": "injected"}}, status_code=failing.pop(0))
            response: Response = await endpoint(request)
            return response

        return call

    def _endpoints(self) -> list[Route]:
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
        ] + ([Route("/metrics", self.metrics.respond, methods=get)] if self.enable_metrics else [])

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
            request = await self.scheduler.admit(obj)
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
                if self.scheduler.dying:
                    raise ConnectionAbortedError("the fake SGLang server died")
                yield b"data: [DONE]\n\n"
            finally:
                if not request.finished:  # the client went away: SGLang aborts it
                    await self.scheduler.abort([request.rid])

        return StreamingResponse(lines(), media_type="text/event-stream")

    async def _abort_request(self, http: Request) -> Response:
        obj = await http.json()
        if obj.get("abort_all"):
            await self.scheduler.abort(None)
        elif obj.get("rid"):
            await self.scheduler.abort([obj["rid"]])
        return Response(status_code=200)

    async def _pause(self, http: Request) -> Response:
        body = await http.body()
        await self.scheduler.pause(json.loads(body).get("mode", "abort") if body else "abort")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, http: Request) -> Response:
        self.scheduler.resume_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def _release(self, http: Request) -> Response:
        tags = await _tags(http)
        if self.memory_saver:  # without it SGLang's release is a no-op
            try:
                await self.scheduler.release(tags, cpu_backup=self.cpu_backup)
            except ValueError as e:
                return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        return Response(status_code=200)

    async def _resume(self, http: Request) -> Response:
        tags = await _tags(http)
        if self.memory_saver:
            await self.scheduler.resume(tags)
        return Response(status_code=200)

    async def _init_group(self, http: Request) -> Response:
        obj = await http.json()
        world_size, offset = int(obj["world_size"]), int(obj["rank_offset"])
        name = obj.get("group_name", _GROUP_NAME)
        timeout = datetime.timedelta(seconds=60)
        if name in self._groups:
            # init_custom_process_group -> torch's _new_process_group_helper: a name
            # stays taken until /destroy_weights_update_group destroys its group.
            return JSONResponse(
                {
                    "success": False,
                    "message": "Failed to initialize custom process group: The specified "
                    "group name has already been created, please use a different group name.",
                },
                status_code=400,
            )

        def join(rank: int) -> Any:
            # Each TP worker joins as rank_offset + tp_rank (ModelRunner.
            # init_weights_update_group) over the trainer's store, keyed as
            # init_custom_process_group + _new_process_group_helper key it.
            store = TCPStore(
                obj["master_address"], int(obj["master_port"]), world_size,
                is_master=False, timeout=timeout,
            )  # fmt: skip
            keys = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, store)))
            return torch.distributed.ProcessGroupGloo(keys, rank, world_size, timeout)

        ranks = tuple(range(offset, offset + self.tp))
        try:
            groups = await asyncio.gather(*(asyncio.to_thread(join, r) for r in ranks))
        except Exception as e:
            return JSONResponse(
                {"success": False, "message": f"Failed to init group: {e}."}, status_code=400
            )
        self._groups[name], self.group_ranks = list(groups), ranks
        return JSONResponse(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def _update_weights(self, http: Request) -> Response:
        obj = await http.json()
        groups = self._groups.get(obj.get("group_name", _GROUP_NAME))
        if not groups:
            return JSONResponse(
                {"success": False, "message": "The weight update group is not initialized."},
                status_code=400,
            )
        if obj.get("abort_all_requests"):
            await self.scheduler.abort(None)
        await self.scheduler.wait_idle()  # model_update_lock: running requests finish
        specs = list(zip(obj["names"], obj["dtypes"], obj["shapes"], strict=True))
        flattened = obj.get("load_format") == "flattened_bucket"
        try:
            received = await asyncio.gather(
                *(asyncio.to_thread(_receive, group, specs, flattened) for group in groups)
            )
            tensors = received[0]  # every TP worker received the same tensors
            known = dict(self.engine.model.named_parameters())
            for name, tensor in tensors.items():  # as a model's load_weights fails
                if name not in known:
                    raise KeyError(name)  # params_dict[name]
                if known[name].shape != tensor.shape:  # its weight_loader's assertion
                    raise AssertionError(f"{tuple(known[name].shape)} != {tuple(tensor.shape)}")
        except Exception as e:
            # ModelRunner.update_weights_from_distributed: a failed broadcast and a
            # failed load end alike.
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update parameter online: {e}. The full weights "
                    "of the ModelRunner are partially updated. Please discard the whole "
                    "weights.",
                },
                status_code=400,
            )
        version = obj.get("weight_version")
        await self.scheduler.load_weights(
            tensors, version, flush_cache=bool(obj.get("flush_cache", True))
        )
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message})

    async def _destroy_group(self, http: Request) -> Response:
        obj = await http.json()
        if self._groups.pop(obj.get("group_name", _GROUP_NAME), None) is None:
            return JSONResponse(
                {"success": False, "message": "The group to be destroyed does not exist."},
                status_code=400,
            )
        self.group_ranks = ()
        return JSONResponse(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def _server_info(self, http: Request) -> Response:
        load = self.engine.stats()
        state: dict[str, Any] = {"num_running_reqs": load.num_running}
        if self.reports_running_limit:
            state["effective_max_running_requests_per_dp"] = self.max_running_requests
        return JSONResponse(
            {
                "model_path": self._model_path(),
                "tp_size": self.tp,
                "dp_size": 1,
                "context_length": None,
                "enable_memory_saver": self.memory_saver,
                "enable_weights_cpu_backup": self.cpu_backup,
                "enable_priority_scheduling": True,
                "max_running_requests": self.requested_max_running_requests,
                "weight_version": self.weight_version,
                "max_total_num_tokens": self.scheduler.kv_capacity_tokens,
                "max_req_input_len": self.model.max_seq_len - 1,
                "internal_states": [state],
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
        self.num_load_calls += 1
        load = self.engine.stats()
        waiting = [r for r in self.scheduler.requests.values() if not r.token_ids]
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load.num_running + load.num_queued,
                    "num_waiting_reqs": load.num_queued,
                    "num_tokens": load.kv_tokens + sum(len(r.input_ids) for r in waiting),
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
        self.scheduler.prefix_cache.flush()
        return Response("Cache flushed.\n", status_code=200)

    def _model_path(self) -> str:
        return self.model.path or "dynarl-random-init"


def _receive(group: Any, specs: list[Any], flattened: bool) -> dict[str, torch.Tensor]:
    """One TP worker's side of ``update_weights_from_distributed``."""
    if flattened:
        # _update_bucketed_weights_from_distributed: one broadcast of the tensors
        # flattened and concatenated in order (FlattenedTensorBucket).
        parts = [torch.empty(shape, dtype=getattr(torch, dt)) for _, dt, shape in specs]
        flat = torch.cat([p.flatten() for p in parts])
        broadcast(flat, group=group, group_src=0)
        tensors, start = {}, 0
        for (name, _, shape), part in zip(specs, parts, strict=True):
            tensors[name] = flat[start : start + part.numel()].reshape(shape)
            start += part.numel()
        return tensors
    tensors = {}
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        broadcast(tensor, group=group, group_src=0)
        tensors[name] = tensor
    return tensors


async def _tags(http: Request) -> list[MemoryTag]:
    body = await http.body()
    tags = json.loads(body).get("tags") if body else None
    return [t for t in ALL_MEMORY if not tags or t in tags]


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
