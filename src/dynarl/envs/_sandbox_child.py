"""Watching one sandboxed child process until it ends, whatever it does.

:class:`ChildWatch` feeds the child's stdin, drains its stdout and stderr concurrently
(so a flood never blocks it on a full pipe) into :class:`OutputCapture`s that keep the
first bytes, and kills the child's whole process group (it is a session leader) when it
runs past its time or floods its output. Used by :mod:`dynarl.envs.sandbox`.
"""

import contextlib
import os
import signal

import anyio
import anyio.abc

_TAIL_BYTES = 4096
_KILL_GRACE_S = 2.0


class OutputCapture:
    """One output stream: its first ``limit`` bytes, its size, and its last 4 KiB (where
    a traceback says what went wrong, even past the limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_bytes = 0
        self._kept = bytearray()
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        """Count ``chunk``, keep what fits under the limit, remember the tail."""
        self.num_bytes += len(chunk)
        room = self.limit - len(self._kept)
        if room > 0:
            self._kept += chunk[:room]
        self._tail += chunk
        del self._tail[:-_TAIL_BYTES]

    @property
    def truncated(self) -> bool:
        """More was written than kept."""
        return self.num_bytes > self.limit

    def text(self) -> str:
        """The kept bytes, decoded (undecodable bytes replaced)."""
        return self._kept.decode("utf-8", errors="replace")

    def tail_text(self) -> str:
        """The last bytes written, decoded."""
        return self._tail.decode("utf-8", errors="replace")


class ChildWatch:
    """Runs a started child to its end: its exit, ``timeout_s``, or a flood (a stream
    passing ``flood_bytes``). Either of the last two kills its process group.

    Attributes:
        stdout, stderr: what the child wrote.
        timed_out: the child was killed at ``timeout_s``.
        flooded: the stream (``"stdout"`` or ``"stderr"``) whose flood killed it, if any.
    """

    def __init__(
        self,
        process: anyio.abc.Process,
        *,
        timeout_s: float,
        max_output_bytes: int,
        flood_bytes: int,
    ) -> None:
        self.stdout = OutputCapture(max_output_bytes)
        self.stderr = OutputCapture(max_output_bytes)
        self.timed_out = False
        self.flooded: str | None = None
        self._process = process
        self._timeout_s = timeout_s
        self._flood_bytes = flood_bytes
        self._streams = anyio.CancelScope()

    async def play(self, stdin: bytes) -> None:
        """Feed ``stdin``, drain the output, and return once the child has exited."""
        process = self._process
        assert process.stdout is not None and process.stderr is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watchdog)
            with self._streams:
                async with anyio.create_task_group() as streams:
                    streams.start_soon(self._feed, stdin)
                    streams.start_soon(self._drain, process.stdout, self.stdout, "stdout")
                    streams.start_soon(self._drain, process.stderr, self.stderr, "stderr")
            await process.wait()
            tg.cancel_scope.cancel()

    async def _watchdog(self) -> None:
        await anyio.sleep(self._timeout_s)
        self.timed_out = True
        self._kill()

    def _kill(self) -> None:
        kill_group(self._process.pid)
        # Output still open after the kill belongs to a process that left the group:
        # stop waiting for it.
        self._streams.deadline = anyio.current_time() + _KILL_GRACE_S

    async def _feed(self, data: bytes) -> None:
        stream = self._process.stdin
        assert stream is not None
        # The child may exit or close its stdin without reading it all: that is its call.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            if data:
                await stream.send(data)
            await stream.aclose()

    async def _drain(
        self, stream: anyio.abc.ByteReceiveStream, capture: OutputCapture, name: str
    ) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in stream:
                capture.feed(chunk)
                if capture.num_bytes > self._flood_bytes and self.flooded is None:
                    self.flooded = name
                    self._kill()


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid``; nothing happens if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
