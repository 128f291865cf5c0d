"""An HTTP client of one SGLang server: JSON calls with retries, and the streamed
``/generate`` as an async iterator of decoded chunks.

Retries are a small loop here rather than a retry library's decorator because what
may be retried depends on what the server already did: a call that timed out or got a
5xx is retried with doubling back-off, and every retry is counted
(:attr:`SGLangClient.num_retries`, for the engine's statistics); a ``/generate`` stream
is retried only while it has produced nothing, since one broken after its first chunk
holds tokens the engine must hand back (and resume), not regenerate.
"""

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import httpx
import msgspec

from dynarl.workers.sglang.errors import ProtocolMismatchError, ServerError, ServerLostError
from dynarl.workers.sglang.messages import ErrorResponse, GenerateChunk, GenerateReqInput

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ENCODER = msgspec.json.Encoder()
_CHUNK = msgspec.json.Decoder(GenerateChunk)
_ERROR = msgspec.json.Decoder(ErrorResponse)
_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class SGLangClient:
    """Calls to one server at ``url``.

    Args:
        url: ``http://host:port``.
        request_timeout_s: how long a call (a stream: each chunk) may wait.
        connect_timeout_s: how long connecting may take.
        max_retries: retries of a timed-out or 5xx call.
        retry_backoff_s: delay before the first retry (doubling after).
        sleep: how to wait between retries (injected by tests).
    """

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.url = url.rstrip("/")
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._max_retries = max_retries
        self._backoff_s = retry_backoff_s
        self._sleep = sleep
        self._client: httpx.AsyncClient | None = None
        self.num_retries = 0
        """Calls retried after a timeout, a broken connection or a 5xx."""

    @property
    def client(self) -> httpx.AsyncClient:
        """The connection pool (made on first use, inside the event loop)."""
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self._timeout)
        return self._client

    async def aclose(self) -> None:
        """Close the connections."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def get(self, path: str, result: type[T]) -> T:
        """``GET path``, decoded as ``result``."""
        response = await self._call("GET", path, None)
        return _decode(path, response.content, result)

    async def get_text(self, path: str, *, retry: bool = True) -> str:
        """``GET path`` as text (``/metrics``: Prometheus' exposition format);
        ``retry`` as for :meth:`post`."""
        response = await self._call("GET", path, None, retry=retry)
        return response.text

    async def post(self, path: str, body: object | None = None, *, retry: bool = True) -> bytes:
        """``POST path`` with ``body`` as JSON; returns the response body. Without
        ``retry``, one attempt: for a call that is not idempotent (one that joins a
        collective, which a second attempt would enter again with no peer)."""
        response = await self._call("POST", path, body, retry=retry)
        return response.content

    async def post_as(
        self, path: str, body: object | None, result: type[T], *, retry: bool = True
    ) -> T:
        """``POST path``, decoded as ``result`` (``retry`` as for :meth:`post`)."""
        return _decode(path, await self.post(path, body, retry=retry), result)

    async def generate(self, request: GenerateReqInput) -> AsyncIterator[GenerateChunk]:
        """Stream ``/generate``: each ``data:`` line decoded, until ``data: [DONE]``.

        Raises:
            ServerError: the server refused the request (4xx, or a 5xx after the
                retries, or an ``error`` chunk).
            ServerLostError: the stream broke after it produced a chunk, or the
                server could not be reached after the retries.
        """
        body = _ENCODER.encode(request)
        for attempt in range(self._max_retries + 1):
            produced = False
            try:
                async with self.client.stream(
                    "POST", "/generate", content=body, headers=_JSON
                ) as response:
                    if response.status_code >= 500 and attempt < self._max_retries:
                        await response.aread()
                        await self._back_off(attempt, f"/generate: HTTP {response.status_code}")
                        continue
                    if response.status_code >= 400:
                        raise _server_error(
                            "/generate", response.status_code, await response.aread()
                        )
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        chunk = _decode("/generate", data.encode(), GenerateChunk)
                        if chunk.error is not None:
                            raise ServerError(
                                f"/generate: {chunk.error.get('message', chunk.error)}", status=400
                            )
                        produced = True
                        yield chunk
                    raise ServerLostError(
                        f"{self.url}/generate: the stream ended without [DONE]; the server "
                        f"closed it"
                    )
            except _RETRYABLE as e:
                if produced:
                    raise ServerLostError(f"{self.url}/generate: the stream broke: {e!r}") from e
                if attempt == self._max_retries:
                    raise ServerLostError(
                        f"{self.url}/generate: no answer after {attempt + 1} attempts: {e!r}"
                    ) from e
                await self._back_off(attempt, repr(e))

    async def _call(
        self, method: str, path: str, body: object | None, *, retry: bool = True
    ) -> httpx.Response:
        content = None if body is None else _ENCODER.encode(body)
        retries = self._max_retries if retry else 0
        for attempt in range(retries + 1):
            try:
                response = await self.client.request(
                    method, path, content=content, headers=_JSON if content else None
                )
            except _RETRYABLE as e:
                if attempt == retries:
                    raise ServerError(
                        f"{self.url}{path}: no answer after {attempt + 1} attempts: {e!r}; "
                        f"is the server running?",
                        status=0,
                    ) from e
                await self._back_off(attempt, repr(e))
                continue
            if response.status_code >= 500 and attempt < retries:
                await self._back_off(attempt, f"{path}: HTTP {response.status_code}")
                continue
            if response.status_code >= 400:
                raise _server_error(path, response.status_code, response.content)
            return response
        raise AssertionError("unreachable")

    async def _back_off(self, attempt: int, why: str) -> None:
        self.num_retries += 1
        delay = self._backoff_s * 2**attempt
        logger.warning("%s: %s; retrying in %.2f s", self.url, why, delay)
        await self._sleep(delay)


_JSON = {"content-type": "application/json"}


def _decode(path: str, content: bytes, result: type[T]) -> T:
    try:
        return msgspec.json.decode(content, type=result)
    except msgspec.DecodeError as e:
        raise ProtocolMismatchError(
            f"{path} answered {content[:200]!r}, which is not the {result.__name__} this "
            f"adapter expects ({e}); is this an SGLang 0.5.x server?"
        ) from e


def _server_error(path: str, status: int, content: bytes) -> ServerError:
    message: Any = content[:500].decode(errors="replace")
    try:
        error = _ERROR.decode(content)
        message = error.message or (error.error or {}).get("message") or message
    except msgspec.DecodeError:
        with contextlib.suppress(ValueError):
            message = json.loads(content)
    return ServerError(f"{path}: HTTP {status}: {message}", status=status)
