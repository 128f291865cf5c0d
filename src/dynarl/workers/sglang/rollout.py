"""The SGLang rollout engine: the :class:`~dynarl.workers.rollout.RolloutEngine`
protocol over one SGLang server's HTTP API.

Every request is one streamed ``/generate`` (``input_ids`` = prompt + any partial
output, ``return_logprob``, ``rid`` = the request id, ``priority``), served by its own
task in :meth:`SGLangRollout.run`'s task group; its tokens and log-probs are taken from
``meta_info.output_token_logprobs`` as they arrive, so whatever ends the stream (a
finish, an abort, the server dying) the request's output so far is known exactly.
An abort (``/abort_request`` by rid; ``/pause_generation`` for all) ends the streams
with an abort reason, and each request comes back holding its partial output; another
engine resumes it by prefilling prompt + partial output, with ``max_new_tokens``
reduced by what was generated. Releasing memory retracts the running requests
(``/pause_generation`` ``retract``) and frees weights and KV cache; resuming takes them
back and continues.
"""

import logging
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from dynarl.data.request_order import OrderName
from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import EngineLoad, GenerateRequest, RequestSink
from dynarl.workers.sglang import messages as m
from dynarl.workers.sglang.arrival_rate import ArrivalRate
from dynarl.workers.sglang.client import SGLangClient
from dynarl.workers.sglang.errors import (
    ProtocolMismatchError,
    ServerError,
    ServerLostError,
    SGLangError,
)
from dynarl.workers.sglang.handshake import running_limit
from dynarl.workers.sglang.live import LiveRequest, Outcome
from dynarl.workers.sglang.server_group import ServerGroup
from dynarl.workers.sglang.step_metrics import StepTally, parse_server_steps
from dynarl.workers.weights import WeightManifest, WeightReceiver, WeightSyncGroup

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 5.0
"""How far back :meth:`SGLangRollout.load` measures generation throughput."""


class SGLangRollout:
    """A rollout engine served by the SGLang server behind ``client``.

    Args:
        client: the server's client.
        name: for log lines.
        info: the server's ``/get_server_info`` (checked by :func:`check_server`).
        context_len: the model's context length (``/v1/models``).
        max_running_requests: the configured batch (``rollout.max_running_requests``),
            what :attr:`max_running_requests` says when the server does not say its own.
        weight_version: the version of the weights the server holds.
        stats_interval_s: how often :meth:`run` reads the server's ``/get_load``.
        weight_sync_backend: the collective backend of weight-sync groups.
        on_close: called once :meth:`run` ends (stops a launched server).
        order: the role's request order: with ``priority``, a request without a
            priority of its own is sent with ``priority=tool_calls`` (SGLang's priority
            scheduling serves larger first, then by arrival).
        now_s: clock for throughput.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        name: str,
        info: m.ServerInfo,
        context_len: int,
        max_running_requests: int,
        weight_version: int = 0,
        stats_interval_s: float = 1.0,
        weight_sync_backend: str = "nccl",
        on_close: Callable[[], None] = lambda: None,
        order: OrderName = "fifo",
        now_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self._order = order
        self.client = client
        self.name = name
        self.info = info
        self.context_len = context_len
        self._configured_max_running = max_running_requests
        self._version = weight_version
        self._stats_interval_s = stats_interval_s
        self._on_close = on_close
        self._closed = False  # closed: its server is (or may be) gone, nothing to poll
        self._now_s = now_s
        self._live: dict[str, LiveRequest] = {}
        self._incoming: MemoryObjectSendStream[LiveRequest] | None = None
        self._error: Exception | None = None
        self._held = False  # memory released: unasked-for aborts are resubmitted on resume
        self._parked: list[LiveRequest] = []
        self._group = ServerGroup(
            client, name=name, tp_size=info.tp_size, backend=weight_sync_backend
        )
        self._rate = ArrivalRate(THROUGHPUT_WINDOW_S)
        self._steps = StepTally(name)
        self._server_load: tuple[float, list[m.LoadReport]] | None = None
        self.num_server_aborts = 0
        """Requests the server ended with an abort the engine did not ask for."""

    # ------------------------------------------------------------------ state

    @property
    def weight_version(self) -> int:
        """Version of the weights the server holds."""
        return self._version

    @property
    def max_running_requests(self) -> int:
        """Requests the server runs at once, as it reports them
        (:func:`~dynarl.workers.sglang.handshake.running_limit`), else the configured
        batch. Not the smaller of the two: every request goes to the server as soon as
        it is submitted, so the server's own limit is what binds, whatever the
        configuration says."""
        return running_limit(self.info) or self._configured_max_running

    @property
    def num_requests(self) -> int:
        """Requests in the engine (waiting, streaming, or parked while released)."""
        return len(self._live)

    @property
    def error(self) -> Exception | None:
        """Why the engine stopped serving (the server was lost)."""
        return self._error

    @property
    def num_retries(self) -> int:
        """Calls to the server retried after a timeout, a broken connection or a 5xx."""
        return self.client.num_retries

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens the server found in its prefix cache for a request it holds
        (``meta_info.cached_tokens``; 0 before its first chunk or once it left)."""
        live = self._live.get(request_id)
        return 0 if live is None else live.cached_tokens

    # ------------------------------------------------------------------ serving

    async def run(self) -> None:
        """Serve submitted requests, each on its own stream, until cancelled or the
        server is lost (then :attr:`error` is set, every request still here is handed
        back to its sink with its partial output, and this returns). Requests whose
        streams an earlier run left (cancelled) continue from their output so far."""
        incoming, queue = anyio.create_memory_object_stream[LiveRequest](float("inf"))
        for live in self._live.values():
            if live.outcome is None and not live.serving:
                incoming.send_nowait(live)
        self._incoming = incoming
        try:
            async with anyio.create_task_group() as tg, queue:
                tg.start_soon(self._poll_load)
                async for live in queue:
                    if live.outcome is None:
                        tg.start_soon(self._serve, live)
        finally:
            self._incoming = None
            incoming.close()
            with anyio.CancelScope(shield=True):
                await self.client.aclose()
            if self._error is not None:
                self._on_close()

    def close(self) -> None:
        """Stop a server this engine launched (a no-op for one it attached to); its
        load is no longer read (a server started on the same port is another's)."""
        self._closed = True
        self._on_close()

    async def submit(self, requests: Sequence[GenerateRequest], sink: RequestSink) -> None:
        """Queue ``requests``; all or none (a bad one raises :class:`BadRequestError`)."""
        ids = [r.request_id for r in requests]
        clash = set(ids) & self._live.keys()
        if clash or len(set(ids)) != len(ids):
            raise BadRequestError(
                f"requests {sorted(clash) or ids} are already in this engine; use new ids"
            )
        for request in requests:
            self._validate(request)
        if self._error is not None:
            for request in requests:
                sink.aborted(request)
            await sink.flush()
            return
        for request in requests:
            live = LiveRequest(request, sink)
            self._live[request.request_id] = live
            self._enqueue(live)

    async def abort(self, request_ids: Sequence[str] | None) -> list[GenerateRequest]:
        """End requests (all when ``None``) and return each with its partial output;
        a request that finished meanwhile completes instead and is not returned."""
        wanted = None if request_ids is None else set(request_ids)
        targets = [live for rid, live in self._live.items() if wanted is None or rid in wanted]
        for live in targets:
            live.abort_requested = True
            if not live.serving:  # queued here, or its task ended with the run
                live.settle("aborted")
        on_server = [live for live in targets if live.serving]
        paused = False
        if on_server:
            if wanted is None:
                await self.client.post("/pause_generation", m.PauseGenerationReqInput())
                paused = True
            else:
                for live in on_server:
                    await self.client.post(
                        "/abort_request", m.AbortReq(rid=live.request.request_id)
                    )
        try:
            for live in targets:
                await live.settled.wait()
        finally:
            if paused:
                await self.client.post("/continue_generation", {})
        taken: list[GenerateRequest] = []
        sinks: dict[int, RequestSink] = {}
        for live in targets:
            if live.outcome == "aborted":
                self._live.pop(live.request.request_id, None)
                request = live.partial()
                live.sink.aborted(request)
                sinks[id(live.sink)] = live.sink
                taken.append(request)
        for sink in sinks.values():
            await sink.flush()
        return taken

    async def end_sessions(self, session_ids: Sequence[str]) -> None:
        """Nothing to drop: this adapter keeps nothing per session, and the server's
        radix cache shares KV by token prefix across requests (not per session) and
        evicts it least-recently-used on its own."""

    def load(self) -> EngineLoad:
        """Requests running (prefilled: streaming) and queued, as this engine knows
        them; KV tokens: its running requests' tokens, or the server's last report
        (``/get_load``, which counts waiting requests' input too) when fresh and more;
        decode steps and the seconds of its steps by kind, where the server counts them
        (:mod:`~dynarl.workers.sglang.step_metrics`; ``prefill_steps`` stays 0: SGLang
        does not count its prefill passes)."""
        now = self._now_s()
        running = [live for live in self._live.values() if live.streaming]
        kv_tokens = sum(len(live.input_ids) for live in running)
        steps = self._steps.counts
        if (
            self._server_load is not None
            and now - self._server_load[0] < 2 * self._stats_interval_s
        ):
            kv_tokens = max(kv_tokens, sum(report.num_tokens for report in self._server_load[1]))
        return EngineLoad(
            kv_usage=min(1.0, kv_tokens / max(1, self.info.max_total_num_tokens)),
            num_running=len(running),
            num_queued=len(self._live) - len(running),
            gen_tokens_per_s=self._rate.rate(now),
            kv_tokens=kv_tokens,
            decode_steps=steps.decode_steps,
            decode_s=steps.decode_s,
            prefill_s=steps.prefill_s,
            resume_prefill_s=steps.resume_prefill_s,
            decode_tokens=steps.decode_tokens,
        )

    # ------------------------------------------------------------------ memory

    async def release_memory(self, *, host_backup: bool) -> None:
        """Retract the running requests and free weights and KV cache."""
        if host_backup and not self.info.enable_weights_cpu_backup:
            raise SGLangError(
                f"{self.name}: releasing memory with a host backup needs the server started "
                f"with --enable-weights-cpu-backup (and --enable-memory-saver); restart it "
                f"so, or let dynarl launch it (rollout.sglang.urls empty)"
            )
        self._held = True
        await self.client.post("/pause_generation", m.PauseGenerationReqInput(mode="retract"))
        await self.client.post("/release_memory_occupation", m.MemoryTagsReqInput())

    async def resume_memory(self) -> None:
        """Take the memory back and continue (requests the server ended meanwhile are
        submitted again with their partial output)."""
        await self.client.post("/resume_memory_occupation", m.MemoryTagsReqInput())
        await self.client.post("/continue_generation", {})
        self._held = False
        parked, self._parked = self._parked, []
        for live in parked:
            again = LiveRequest(live.partial(), live.sink)
            self._live[again.request.request_id] = again
            self._enqueue(again)

    # ------------------------------------------------------------------ weights

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Have the server join the weight-sync group: its tensor-parallel workers take
        ``group.num_ranks`` ranks from ``group.rank`` (see :class:`ServerGroup`)."""
        await self._group.join(group)

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Have the server receive the broadcast ``manifest`` describes and take its
        version; returns it."""
        self._version = await self._group.receive(manifest)
        return self._version

    async def leave_weight_sync(self) -> None:
        """Have the server leave the group (``/destroy_weights_update_group``)."""
        await self._group.leave()

    def adopt_weight_sync(self, other: WeightReceiver) -> bool:
        """Never: the group membership is the server's, not this process's."""
        return False

    # ------------------------------------------------------------------ internals

    def _enqueue(self, live: LiveRequest) -> None:
        """Hand ``live`` to the running :meth:`run` (a later run takes it otherwise)."""
        if self._incoming is not None:
            self._incoming.send_nowait(live)

    def _validate(self, request: GenerateRequest) -> None:
        rid = request.request_id
        context = len(request.prompt_ids) + len(request.output_ids)
        if not request.prompt_ids:
            raise BadRequestError(f"request {rid!r} has an empty prompt; give at least one token")
        if len(request.output_logprobs) != len(request.output_ids):
            raise BadRequestError(f"request {rid!r} needs one output log-prob per output token")
        if context >= self.context_len - 1:
            raise BadRequestError(
                f"request {rid!r} has {context} tokens, leaving no room under the server's "
                f"context length {self.context_len}; shorten the prompt"
            )
        if len(request.output_ids) >= request.sampling.max_new_tokens:
            raise BadRequestError(f"request {rid!r} already has max_new_tokens output tokens")

    def _priority(self, request: GenerateRequest) -> int | None:
        """SGLang's ``priority`` of ``request`` (larger first): its own, else with the
        priority order its completed tool calls (the order's first key; a longer cached
        prefix, its second, is what SGLang's ``lpm`` schedule policy prefers)."""
        if request.priority:
            return request.priority
        return request.tool_calls if self._order == "priority" else None

    async def _serve(self, live: LiveRequest) -> None:
        live.serving = True
        try:
            await self._stream(live)
        except ServerLostError as e:
            self._finish(live, "lost")
            await self._lost(e)
        except ServerError as e:
            # Validated here, refused there: hand it back for another engine.
            logger.warning("%s: the server refused %s: %s", self.name, live.request.request_id, e)
            self._finish(live, "aborted")
        except anyio.get_cancelled_exc_class():
            live.serving = False  # the run ends; abort() hands it back
            raise
        await self._flush(live)

    async def _stream(self, live: LiveRequest) -> None:
        live.posted = True
        body = live.generate_input(
            context_len=self.context_len, priority=self._priority(live.request)
        )
        resumed = len(body.input_ids) > len(live.request.prompt_ids)
        first = True
        async for chunk in self.client.generate(body):
            meta = chunk.meta_info
            if meta is None:
                raise ProtocolMismatchError(f"/generate sent a chunk without meta_info: {chunk}")
            new = live.apply(meta)
            if new:
                self._rate.arrived(self._now_s(), new)
                if first:
                    self._steps.prefilled(
                        len(body.input_ids) - (meta.cached_tokens or 0), resumed=resumed
                    )
                self._steps.generated(new, first=first)
                first = False
            live.streaming = True
            if live.abort_requested and not live.abort_resent:
                # An abort sent before the server knew the rid was ignored there.
                live.abort_resent = True
                await self.client.post("/abort_request", m.AbortReq(rid=live.request.request_id))
            reason = meta.finish_reason
            if reason is None:
                continue
            if reason.type != "abort":
                self._finish(live, "done", reason.type)
            elif live.abort_requested:
                live.settle("aborted")  # abort() hands it back
            elif self._held:
                self._live.pop(live.request.request_id, None)
                self._parked.append(live)
                live.settle("aborted")
            else:
                self.num_server_aborts += 1
                logger.warning("%s: the server aborted %s: %s", self.name, meta.id, reason.message)
                self._finish(live, "aborted")
            return
        raise ServerLostError(f"{self.client.url}/generate ended without a finish reason")

    def _finish(self, live: LiveRequest, outcome: Outcome, reason: str = "") -> None:
        if live.outcome is not None:
            return
        self._live.pop(live.request.request_id, None)
        if outcome == "done":
            live.sink.done(live.completion(reason, engine_version=self._version))
        else:
            live.sink.aborted(live.partial())
        live.settle(outcome)

    async def _flush(self, live: LiveRequest) -> None:
        if live.outcome in ("done", "lost") or (
            live.outcome == "aborted" and not live.abort_requested
        ):
            await live.sink.flush()

    async def _lost(self, error: ServerLostError) -> None:
        if self._error is None:
            logger.error("%s: lost its SGLang server: %s", self.name, error)
            self._error = error
            if self._incoming is not None:
                self._incoming.close()
            queued = [live for live in self._live.values() if not live.serving]
            for live in queued:
                self._finish(live, "lost")
            for sink in {id(live.sink): live.sink for live in queued}.values():
                await sink.flush()

    async def _poll_load(self) -> None:
        while self._error is None and not self._closed:
            try:
                reports = await self.client.get("/get_load", list[m.LoadReport])
                self._server_load = (self._now_s(), reports)
            except SGLangError as e:
                logger.debug("%s: /get_load failed: %s", self.name, e)
            if self._steps.counting:
                await self._read_steps()
            await anyio.sleep(self._stats_interval_s)

    async def _read_steps(self) -> None:
        """Read the server's step counters (``/metrics``) into the engine's tally; stop
        for good where the server keeps none."""
        try:
            text = await self.client.get_text("/metrics", retry=False)
            steps = parse_server_steps(text)
        except ServerError as e:
            if e.status == 404:
                self._steps.stop(
                    f"the SGLang server at {self.client.url} serves no /metrics (start it "
                    f"with --enable-metrics to have its decode steps counted)"
                )
            else:
                logger.debug("%s: /metrics failed: %s", self.name, e)
            return
        except ValueError as e:
            self._steps.stop(f"the SGLang server's /metrics is not Prometheus text ({e})")
            return
        if steps is None:
            self._steps.stop(
                f"the SGLang server at {self.client.url} keeps no decode-step counters of one "
                f"batch (sglang:cuda_graph_passes_total, sglang:gpu_execution_seconds_total; "
                f"one data-parallel rank)"
            )
            return
        self._steps.read(steps)
