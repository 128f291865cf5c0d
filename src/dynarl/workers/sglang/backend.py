"""The SGLang backend's entry in the backend table: it builds a slot's rollout engine
on an SGLang server, launched for it or one the user runs. Called in a slot's worker
thread: launching waits for the server's ``/health``."""

import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from dynarl.core.config import Accelerator
from dynarl.data.request_order import OrderName
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.sglang.checkpoint import PolicyCheckpoint
from dynarl.workers.sglang.client import SGLangClient
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.errors import ProtocolMismatchError, ServerError
from dynarl.workers.sglang.gpus import server_env, visible_gpus
from dynarl.workers.sglang.handshake import check_server
from dynarl.workers.sglang.launcher import ServerProcess, server_command
from dynarl.workers.sglang.rollout import SGLangRollout

logger = logging.getLogger(__name__)

SERVER_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}
"""Environment of launched servers: report log-probs of the model's own distribution
(temperature 1), which is what dynarl's completions carry, not the tempered one; and
time each forward pass on the device (``sglang:gpu_execution_seconds_total``, the
decode and prefill seconds :mod:`~dynarl.workers.sglang.step_metrics` reads)."""


class SGLangBackend:
    """Builds rollout engines served by SGLang."""

    def build_rollout(self, role: RolloutRole, *, name: str, num_threads: int) -> SGLangRollout:
        """An engine on server ``i`` of ``role.rollout.sglang``, launched first when no
        URLs are configured (``i``: ``role.server_index``, else the slot's index from
        ``name``, ``slot-i``): on the GPUs of the role's devices with
        ``cluster.accelerator=cuda`` (:mod:`~dynarl.workers.sglang.gpus`), at their
        tensor-parallel size, with a random-init policy written as a checkpoint for it
        when ``role.model.path`` is unset."""
        config = role.rollout.sglang
        index = _index(name)
        if not config.launches:
            url = config.urls[index % len(config.urls)]
            engine = connect(
                config,
                url=url,
                name=name,
                max_running_requests=role.rollout.max_running_requests,
                order=role.order,
                accelerator=role.accelerator,
            )
            _note_server_limits(engine, role)
            _note_batch_limit(engine, role)
            return engine
        devices = role.engine_devices
        env = dict(SERVER_ENV)
        if role.accelerator == "cuda":
            env.update(server_env(devices, visible_gpus()))
        stop = contextlib.ExitStack()  # closed by the engine, or here on failure
        try:
            model_path = role.model.path
            owned: list[str] = []
            if model_path is None:
                checkpoint = PolicyCheckpoint(role.model, seed=role.seed)
                stop.callback(checkpoint.remove)
                model_path = checkpoint.path
                owned.append(checkpoint.path)
            port = config.port_base + (index if role.server_index is None else role.server_index)
            command = server_command(
                config,
                model_path=model_path,
                rollout=role.rollout,
                context_length=role.model.max_seq_len,
                dtype=role.model.dtype,
                seed=role.seed,
                port=port,
                tp=len(devices),
                kv_tokens=role.kv_capacity_tokens,
                order=role.order,
            )
            server = ServerProcess(
                command, url=f"http://{config.host}:{port}", env=env, owned=owned
            )
            stop.callback(server.stop)
            server.start(timeout_s=config.startup_timeout_s)
            engine = connect(
                config,
                url=server.url,
                name=name,
                max_running_requests=role.rollout.max_running_requests,
                on_close=stop.close,
                order=role.order,
                accelerator=role.accelerator,
            )
            _note_batch_limit(engine, role)
            return engine
        except BaseException:
            stop.close()
            raise


def connect(
    config: SGLangConfig,
    *,
    url: str,
    name: str,
    max_running_requests: int,
    on_close: Callable[[], None] | None = None,
    order: OrderName = "fifo",
    accelerator: Accelerator = "cpu",
) -> SGLangRollout:
    """An engine on the server at ``url``, once it is known to speak this adapter's
    protocol (a clear :class:`ProtocolMismatchError` otherwise); its weight-sync group
    speaks the backend of the trainer's sender on ``accelerator`` unless ``config``
    names one. ``max_running_requests`` (``rollout.max_running_requests``) is its batch
    only if the server does not report its own."""
    with httpx.Client(base_url=url, timeout=config.connect_timeout_s) as http:

        def get(path: str, result: type[Any]) -> Any:
            try:
                response = http.get(path)
            except httpx.HTTPError as e:
                raise ServerError(f"{url}{path}: {e!r}; is the server running?", status=0) from e
            if response.status_code != 200:
                raise ProtocolMismatchError(
                    f"{url}{path} answered HTTP {response.status_code}; is this an SGLang "
                    f"0.5.x server?"
                )
            try:
                return msgspec.json.decode(response.content, type=result)
            except msgspec.DecodeError as e:
                raise ProtocolMismatchError(
                    f"{url}{path} answered what SGLang 0.5.x does not ({e}); run SGLang 0.5.x"
                ) from e

        info, context_len, version = check_server(get, url)
    client = SGLangClient(
        url,
        request_timeout_s=config.request_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        max_retries=config.max_retries,
        retry_backoff_s=config.retry_backoff_s,
    )
    return SGLangRollout(
        client,
        name=name,
        info=info,
        context_len=context_len,
        max_running_requests=max_running_requests,
        weight_version=version,
        stats_interval_s=config.stats_interval_s,
        weight_sync_backend=config.sync_backend(accelerator),
        on_close=on_close or (lambda: None),
        order=order,
    )


def _note_server_limits(engine: SGLangRollout, role: RolloutRole) -> None:
    """An attached server runs with its own KV capacity and tensor-parallel size; say so
    once when the run's configuration names others (the server's apply)."""
    info, rollout = engine.info, role.rollout
    if info.max_total_num_tokens != rollout.kv_capacity_tokens or info.tp_size != rollout.tp:
        logger.warning(
            "%s: the attached server at %s holds %d KV tokens with tp_size=%d; "
            "rollout.kv_capacity_tokens=%d and rollout.tp=%d apply to launched servers "
            "only (the weight-sync group gives this one %d ranks)",
            engine.name,
            engine.client.url,
            info.max_total_num_tokens,
            info.tp_size,
            rollout.kv_capacity_tokens,
            rollout.tp,
            rollout.tp,
        )


def _note_batch_limit(engine: SGLangRollout, role: RolloutRole) -> None:
    """Say once when the server runs another number of requests at once than
    ``rollout.max_running_requests`` (its own flag, or a limit its memory pools set):
    the slot tells the data router the server's."""
    running, configured = engine.max_running_requests, role.rollout.max_running_requests
    if running != configured:
        logger.warning(
            "%s: the server at %s runs %d requests at once, rollout.max_running_requests "
            "is %d; the slot tells the data router %d",
            engine.name,
            engine.client.url,
            running,
            configured,
            running,
        )


def _index(name: str) -> int:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0


BACKEND = SGLangBackend()
"""The SGLang backend (the backend table loads it by this name)."""
