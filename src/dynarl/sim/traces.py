"""Workload traces: record an iteration's requests as JSON lines and replay them.

A trace file holds one header line (:class:`TraceHeader`) and then one
:class:`~dynarl.obs.trace_records.Request` per line, so a run's exact per-request lengths,
turns and tool latencies can be replayed, shared and diffed.
"""

from collections.abc import Iterable
from pathlib import Path

import msgspec

from dynarl.obs.trace_records import TRACE_VERSION, Request, TraceError, TraceHeader
from dynarl.sim.errors import SimError


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed trace: its metadata and its requests, in file order."""

    meta: dict[str, str]
    requests: tuple[Request, ...]


def write_trace(
    path: str | Path, requests: Iterable[Request], *, meta: dict[str, str] | None = None
) -> None:
    """Write ``requests`` to ``path`` as a JSONL trace (overwriting it)."""
    encoder = msgspec.json.Encoder()
    with Path(path).open("wb") as out:
        out.write(encoder.encode(TraceHeader(meta=dict(meta or {}))) + b"\n")
        for request in requests:
            out.write(encoder.encode(request) + b"\n")


def read_trace(path: str | Path) -> Trace:
    """Read a trace written by :func:`write_trace`.

    Raises:
        SimError: the file is not a trace of this version, or a line is malformed (the
            message names the line).
    """
    header_decoder = msgspec.json.Decoder(TraceHeader)
    decoder = msgspec.json.Decoder(Request)
    requests: list[Request] = []
    header: TraceHeader | None = None
    with Path(path).open("rb") as src:
        for number, line in enumerate(src, start=1):
            if not line.strip():
                continue
            try:
                if header is None:
                    header = header_decoder.decode(line)
                else:
                    requests.append(decoder.decode(line))
            except (msgspec.ValidationError, msgspec.DecodeError, TraceError) as exc:
                raise SimError(
                    f"{path}:{number}: not a trace line ({exc}); traces are written "
                    "by dynarl.sim.write_trace"
                ) from exc
    if header is None:
        raise SimError(f"{path}: empty file, not a trace")
    if header.trace_version != TRACE_VERSION:
        raise SimError(
            f"{path}: trace version {header.trace_version}, this dynarl reads "
            f"version {TRACE_VERSION}"
        )
    return Trace(meta=header.meta, requests=tuple(requests))
