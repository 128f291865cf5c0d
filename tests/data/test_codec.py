"""The codec: every message round-trips; bad frames are rejected, counted by kind and
logged once per kind; fuzzed frames never crash the decoder."""

import logging

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynarl.control import events as ev
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId
from dynarl.data import wire
from dynarl.data.codec import Rejections, controller_codec, peek_hello_version, worker_codec

ITEM = wire.Item(
    id=ItemId("a"),
    group=GroupId("g"),
    edge=EdgeId("e"),
    payload=b"\x00\xff",
    affinity="prefer",
    instance=InstanceId("w0"),
    tool_calls=2,
    prefix_tokens=7,
)
RESULT = wire.ItemResult(
    item=ItemId("a"), status="tool_call", payload=b"out", num_tokens=3, prefix_tokens=9
)
TO_WORKER: list[wire.ToWorker] = [
    wire.Welcome(1, InstanceId("w0"), 0.5, 5.0),
    wire.Refused("version", "go away"),
    wire.Work(ITEM),
    wire.WorkBatch((ITEM, ITEM)),
    wire.Abort((ItemId("a"), ItemId("b"))),
    wire.Ping(7),
    wire.Retire("done"),
]
TO_CONTROLLER: list[wire.ToController] = [
    wire.Hello(wire.PROTOCOL_VERSION, InstanceId("w0"), ComponentId("rollout"), 4),
    wire.Pong(7),
    wire.Done(RESULT),
    wire.DoneBatch((RESULT, RESULT)),
    wire.Report(
        ev.EngineStats(instance=InstanceId("w0"), kv_usage=0.5, num_running=1, num_queued=0)
    ),
    wire.Bye("bye"),
]
VALID_FRAMES = [msgspec.msgpack.encode(m) for m in TO_WORKER + TO_CONTROLLER]


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: type(m).__name__)
def test_controller_to_worker_messages_round_trip(msg: wire.ToWorker) -> None:
    sender = controller_codec(Rejections("c"))
    receiver = worker_codec(Rejections("w"))
    assert receiver.decode(sender.encode(msg)) == msg
    assert receiver.rejections.total == 0


@pytest.mark.parametrize("msg", TO_CONTROLLER, ids=lambda m: type(m).__name__)
def test_worker_to_controller_messages_round_trip(msg: wire.ToController) -> None:
    sender = worker_codec(Rejections("w"))
    receiver = controller_codec(Rejections("c"))
    assert receiver.decode(sender.encode(msg)) == msg


def test_each_direction_decodes_only_its_own_messages() -> None:
    codec = controller_codec(Rejections("c"))
    assert codec.decode(codec.encode(wire.Ping(1))) is None
    assert codec.rejections.counts == {"unknown_type": 1}


GOOD = msgspec.msgpack.encode(
    wire.Hello(wire.PROTOCOL_VERSION, InstanceId("w0"), ComponentId("r"), 4)
)


@pytest.mark.parametrize(
    ("frame", "kind"),
    [
        (b"\x00" * 2048, "oversized"),
        (GOOD[:-3], "truncated"),
        (b"", "truncated"),
        (GOOD + b"\x00", "malformed"),
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode(["Launch", 1]), "unknown_type"),
        (msgspec.msgpack.encode(["Hello", "one", "w0", "r", 4]), "invalid"),
        (msgspec.msgpack.encode(["Hello", 1]), "invalid"),
        (msgspec.msgpack.encode({"Hello": 1}), "invalid"),
    ],
)
def test_bad_frames_are_rejected_and_counted_by_kind(frame: bytes, kind: str) -> None:
    codec = controller_codec(Rejections("c"), max_frame_bytes=1024)
    assert codec.decode(frame) is None
    assert codec.rejections.counts == {kind: 1}


def test_each_kind_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    codec = controller_codec(Rejections("c"))
    with caplog.at_level(logging.WARNING, logger="dynarl.data.codec"):
        for _ in range(5):
            codec.decode(b"\xc1")
            codec.decode(GOOD[:-1])
    assert codec.rejections.counts == {"malformed": 5, "truncated": 5}
    assert len(caplog.records) == 2


def test_hello_of_any_version_is_recognised() -> None:
    assert peek_hello_version(GOOD) == wire.PROTOCOL_VERSION
    assert peek_hello_version(msgspec.msgpack.encode(["Hello", 9, {"new": "layout"}])) == 9
    assert peek_hello_version(msgspec.msgpack.encode(["Pong", 9])) is None
    assert peek_hello_version(msgspec.msgpack.encode(["Hello", True])) is None
    assert peek_hello_version(b"\xc1") is None


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    ops = data.draw(
        st.lists(st.sampled_from(["flip", "cut", "insert", "drop"]), min_size=1, max_size=4)
    )
    out = bytearray(frame)
    for op in ops:
        if not out:
            break
        i = data.draw(st.integers(0, len(out) - 1))
        if op == "flip":
            out[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del out[i:]
        elif op == "insert":
            out[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del out[i]
    return bytes(out)


def _check_counted(frames: list[bytes]) -> None:
    for codec in (
        controller_codec(Rejections("c"), max_frame_bytes=4096),
        worker_codec(Rejections("w"), max_frame_bytes=4096),
    ):
        num_bad = 0
        for frame in frames:
            msg = codec.decode(frame)  # must never raise
            if msg is None:
                num_bad += 1
            else:
                # Whatever decodes is a well-typed message that survives a round trip.
                assert codec.decode(codec.encode(msg)) == msg
        assert codec.rejections.total == num_bad


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=256), max_size=20))
def test_fuzz_random_frames_never_crash_and_are_counted(frames: list[bytes]) -> None:
    _check_counted(frames)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_frames_never_crash_and_are_counted(data: st.DataObject) -> None:
    originals = data.draw(st.lists(st.sampled_from(VALID_FRAMES), min_size=1, max_size=12))
    frames = [_mutate(frame, data) for frame in originals]
    _check_counted(frames)


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_fuzz_wellformed_msgpack_of_any_shape_is_counted(obj: object) -> None:
    _check_counted([msgspec.msgpack.encode(obj), msgspec.msgpack.encode(["Hello", obj])])
