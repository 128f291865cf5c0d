"""Frames to messages and back: one encoder, one decoder per direction, and the
rejection counter that keeps bad input from doing harm.

A frame that is oversized, truncated, malformed, of an unknown message type or
otherwise invalid is rejected: :meth:`Codec.decode` returns ``None``, the kind is
counted in :class:`Rejections` and logged once per kind. Decoding never raises.
"""

import logging
from typing import Any, Final, Generic, TypeVar

import msgspec

from dynarl.data import wire

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES: Final = 16 << 20
"""Frames larger than this (16 MiB) are rejected unread."""

REJECT_KINDS: Final = (
    "oversized",
    "truncated",
    "malformed",
    "unknown_type",
    "invalid",
    "unexpected",
    "stale",
    "unauthorized",
)
"""Kinds of rejected input: the first five are bad frames; ``unexpected`` is a valid
message in the wrong state (work before hello), ``stale`` a result for an item the
sender no longer holds (it was declared failed, or the item was taken back);
``unauthorized`` a hello with a wrong or missing run token."""

M = TypeVar("M")


class Rejections:
    """Counts rejected input by kind and logs each kind once.

    Args:
        name: who rejects (for the log line), e.g. ``"router"``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        """Inputs rejected so far, of every kind."""
        return sum(self.counts.values())

    def add(self, kind: str, detail: str) -> None:
        """Count one rejection of ``kind``; log it if it is the first of its kind."""
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        if n == 0:
            logger.warning(
                "%s rejected a frame (%s): %s; further %r rejections are only counted",
                self.name,
                kind,
                detail,
                kind,
            )


class Codec(Generic[M]):
    """Encodes outgoing messages and decodes incoming frames into the union ``M``.

    Use :func:`controller_codec` or :func:`worker_codec` rather than building one.

    Args:
        incoming: the union type incoming frames decode to.
        rejections: where bad frames are counted.
        max_frame_bytes: larger frames are rejected unread.
    """

    def __init__(
        self,
        incoming: Any,
        *,
        rejections: Rejections,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._encoder = msgspec.msgpack.Encoder()
        self.rejections = rejections
        self.max_frame_bytes = max_frame_bytes

    def encode(self, message: msgspec.Struct) -> bytes:
        """The frame for ``message``."""
        return self._encoder.encode(message)

    def decode(self, frame: bytes) -> M | None:
        """The message in ``frame``, or ``None`` (counted) if the frame is bad."""
        if len(frame) > self.max_frame_bytes:
            self.rejections.add(
                "oversized", f"{len(frame)} bytes > max_frame_bytes={self.max_frame_bytes}"
            )
            return None
        try:
            message: M = self._decoder.decode(frame)
            return message
        except msgspec.ValidationError as e:
            text = str(e)
            kind = "unknown_type" if text.endswith("- at `$[0]`") else "invalid"
            self.rejections.add(kind, text)
        except msgspec.DecodeError as e:
            text = str(e)
            self.rejections.add("truncated" if "truncated" in text else "malformed", text)
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            # Defensive: msgspec documents only the two errors above.
            self.rejections.add("malformed", repr(e))
        return None


def controller_codec(
    rejections: Rejections,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Codec[wire.AnyToController]:
    """The controller's codec: decodes what workers send."""
    return Codec[wire.AnyToController](
        wire.AnyToController, rejections=rejections, max_frame_bytes=max_frame_bytes
    )


def worker_codec(
    rejections: Rejections, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Codec[wire.AnyToWorker]:
    """A worker's codec: decodes what the controller sends."""
    return Codec[wire.AnyToWorker](
        wire.AnyToWorker, rejections=rejections, max_frame_bytes=max_frame_bytes
    )


def peek_hello_version(frame: bytes) -> int | None:
    """The protocol version in a frame that looks like any version's ``Hello``
    (``["Hello", version, ...]``), or ``None``. Used to refuse a worker of another
    version in words when its ``Hello`` does not decode as ours."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    if (
        isinstance(obj, list)
        and len(obj) >= 2
        and obj[0] == "Hello"
        and isinstance(obj[1], int)
        and not isinstance(obj[1], bool)
    ):
        return obj[1]
    return None
