"""Frame codec: encode_frame <-> FrameDecoder, framing errors, header decoding."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.protocol.errors import ErrorCode, OnceqError, ProtocolError
from onceq.protocol.frame import (
    _AFTER_LENGTH,
    PREFIX,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    PUSH,
    REQUEST,
    RESPONSE,
    FrameDecoder,
    decode_header,
    encode_frame,
    max_frame_for_body,
)

# msgpack-able header maps: str keys, nested scalars / lists / maps
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=10,
)
headers = st.dictionaries(st.text(max_size=12), _values, max_size=6)
frames_st = st.tuples(
    st.sampled_from([REQUEST, RESPONSE, PUSH]),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFFFFFF),
    headers,
    st.binary(max_size=300),
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


def _decode_all(chunks: list[bytes], max_frame: int | None = None) -> list[tuple]:
    dec = FrameDecoder() if max_frame is None else FrameDecoder(max_frame)
    out: list[tuple] = []
    for c in chunks:
        dec.feed(c)
        out.extend(dec.frames())
    assert dec.buffered == 0
    return out


def _prefix(length: int, version: int = PROTOCOL_VERSION, kind: int = REQUEST, code: int = 1,
            corr: int = 7, hlen: int = 0) -> bytes:
    return PREFIX.pack(length, version, kind, code, corr, hlen)


# ------------------------------------------------------------------ round trip
@settings(max_examples=80, deadline=None)
@given(st.lists(frames_st, min_size=1, max_size=6), st.lists(st.integers(0, 10_000),
                                                               max_size=12))
def test_round_trip_any_split(frames, cuts):
    data = b"".join(encode_frame(*f) for f in frames)
    whole = _decode_all([data])
    pieces = _decode_all(_split(data, cuts))
    bytewise = _decode_all([data[i:i + 1] for i in range(len(data))]) if len(data) < 800 else whole
    assert whole == pieces == bytewise
    assert len(whole) == len(frames)
    for (version, kind, code, corr, hraw, payload), (k, c, cid, h, p) in zip(
        whole, frames, strict=True
    ):
        assert version == PROTOCOL_VERSION
        assert (kind, code, corr) == (k, c, cid)
        assert decode_header(hraw) == h
        assert payload == p
        assert isinstance(payload, bytes) and isinstance(hraw, bytes)


def test_empty_and_none_header():
    for hdr in (None, {}):
        dec = FrameDecoder()
        dec.feed(encode_frame(RESPONSE, 0, 1, hdr, b"xyz"))
        [(_v, kind, code, corr, hraw, payload)] = dec.frames()
        assert (kind, code, corr, payload) == (RESPONSE, 0, 1, b"xyz")
        assert hraw == b"" and decode_header(hraw) == {}


def test_frame_length_field_counts_bytes_after_itself():
    raw = encode_frame(REQUEST, 5, 9, {"a": 1}, b"12345")
    (length,) = struct.unpack_from("<I", raw)
    assert length == len(raw) - 4
    assert len(raw) == PREFIX_SIZE + len(msgpack.packb({"a": 1})) + 5


@settings(max_examples=100, deadline=None)
@given(frames_st, st.data())
def test_truncated_input_yields_nothing(frame, data):
    raw = encode_frame(*frame)
    cut = data.draw(st.integers(0, len(raw) - 1))
    dec = FrameDecoder()
    dec.feed(raw[:cut])
    assert dec.frames() == []
    assert dec.broken is None
    assert dec.buffered == cut
    dec.feed(raw[cut:])
    assert len(dec.frames()) == 1
    assert dec.buffered == 0


def test_frame_exactly_at_limit_is_accepted():
    payload = b"p" * 100
    raw = encode_frame(REQUEST, 1, 1, None, payload)
    limit = len(raw) - 4
    dec = FrameDecoder(limit)
    dec.feed(raw)
    assert len(dec.frames()) == 1
    dec = FrameDecoder(limit - 1)
    dec.feed(raw)
    with pytest.raises(ProtocolError) as ei:
        dec.frames()
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


def test_max_frame_for_body_admits_a_max_body():
    assert max_frame_for_body(1000) >= 1000 + _AFTER_LENGTH


# ------------------------------------------------------------------ framing errors
BAD_PREFIXES = [
    (_prefix(_AFTER_LENGTH, version=2), ErrorCode.UNSUPPORTED_VERSION),
    (_prefix(_AFTER_LENGTH, version=0), ErrorCode.UNSUPPORTED_VERSION),
    (_prefix(10**9), ErrorCode.FRAME_TOO_LARGE),
    (_prefix(0xFFFFFFFF), ErrorCode.FRAME_TOO_LARGE),
    (_prefix(_AFTER_LENGTH, kind=3), ErrorCode.BAD_REQUEST),
    (_prefix(_AFTER_LENGTH, kind=255), ErrorCode.BAD_REQUEST),
    (_prefix(_AFTER_LENGTH + 4, hlen=5), ErrorCode.BAD_REQUEST),
    (_prefix(_AFTER_LENGTH, hlen=0xFFFFFFFF), ErrorCode.BAD_REQUEST),
    (_prefix(_AFTER_LENGTH - 1), ErrorCode.BAD_REQUEST),
    (_prefix(0), ErrorCode.BAD_REQUEST),
]


@pytest.mark.parametrize(("prefix", "code"), BAD_PREFIXES)
def test_bad_prefix_raises_and_stays_broken(prefix, code):
    dec = FrameDecoder()
    dec.feed(prefix)
    with pytest.raises(ProtocolError) as ei:
        dec.frames()
    assert ei.value.code == code
    assert isinstance(ei.value, OnceqError)
    assert dec.broken is ei.value
    # further input does not repair the stream
    dec.feed(encode_frame(REQUEST, 1, 1, {"ok": True}, b"x"))
    for _ in range(2):
        with pytest.raises(ProtocolError) as ei2:
            dec.frames()
        assert ei2.value.code == code


@pytest.mark.parametrize(("prefix", "code"), BAD_PREFIXES)
def test_good_frames_before_a_broken_one_are_returned(prefix, code):
    good = [encode_frame(REQUEST, i, i + 100, {"i": i}, bytes([i]) * i) for i in range(3)]
    dec = FrameDecoder()
    dec.feed(b"".join(good) + prefix + b"\x00" * 50)
    got = dec.frames()
    assert [f[3] for f in got] == [100, 101, 102]
    with pytest.raises(ProtocolError) as ei:
        dec.frames()
    assert ei.value.code == code
    assert dec.broken is not None


def test_bad_prefix_detected_only_once_prefix_is_complete():
    raw = _prefix(_AFTER_LENGTH, version=9)
    dec = FrameDecoder()
    dec.feed(raw[:-1])
    assert dec.frames() == []
    dec.feed(raw[-1:])
    with pytest.raises(ProtocolError):
        dec.frames()


def test_error_carries_corr_id():
    dec = FrameDecoder()
    dec.feed(_prefix(_AFTER_LENGTH, version=3, corr=4242))
    with pytest.raises(ProtocolError) as ei:
        dec.frames()
    assert ei.value.corr_id == 4242  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(0, 1000), max_size=6))
def test_garbage_only_raises_protocol_error(garbage, cuts):
    dec = FrameDecoder(max_frame=4096)
    for chunk in _split(garbage, cuts):
        dec.feed(chunk)
        try:
            frames = dec.frames()
        except ProtocolError:
            assert dec.broken is not None
            with pytest.raises(ProtocolError):
                dec.frames()
            return
        for f in frames:
            assert len(f) == 6
            with contextlib.suppress(ValueError):
                decode_header(f[4])


@settings(max_examples=100, deadline=None)
@given(frames_st, st.integers(0, 200), st.integers(0, 255))
def test_corrupted_frame_prefix_never_raises_other_errors(frame, index, value):
    raw = bytearray(encode_frame(*frame))
    raw[index % PREFIX_SIZE] = value
    dec = FrameDecoder(max_frame=4096)
    dec.feed(bytes(raw) + encode_frame(REQUEST, 1, 1))
    with contextlib.suppress(ProtocolError):
        dec.frames()


# ------------------------------------------------------------------ headers
@pytest.mark.parametrize(
    "junk",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        b"\x2a",  # an int
        b"\x82\xa1a\x01",  # map announcing 2 pairs, 1 present
        b"\x81\xa1a\x01\xff\xff",  # trailing bytes
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G pairs
        b"\xd9\x05ab",  # truncated str8
        b"\xa1",
    ],
)
def test_decode_header_junk_raises_value_error(junk):
    with pytest.raises(ValueError):
        decode_header(junk)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_decode_header_random_bytes(raw):
    try:
        value = decode_header(raw)
    except ValueError:
        return
    assert isinstance(value, dict)


def test_decode_header_accepts_memoryview():
    raw = msgpack.packb({"topic": "t", "n": 3})
    assert decode_header(memoryview(raw)) == {"topic": "t", "n": 3}
    assert decode_header(b"") == {}


def test_decoder_buffers_only_what_it_received():
    """A prefix announcing the largest frame reserves nothing: the buffer holds the bytes
    received, and is empty again once the frame is complete."""
    from onceq.protocol.frame import PREFIX, PROTOCOL_VERSION, REQUEST

    max_frame = 4 * 1024 * 1024 + 64 * 1024
    dec = FrameDecoder(max_frame)
    prefix = PREFIX.pack(max_frame, PROTOCOL_VERSION, REQUEST, 1, 7, 0)
    dec.feed(prefix)
    assert dec.frames() == [] and dec.buffered == len(prefix)
    dec.feed(b"\0" * 1000)
    assert dec.frames() == [] and dec.buffered == len(prefix) + 1000
    dec.feed(b"\0" * (max_frame - 12 - 1000))
    (frame,) = dec.frames()
    assert frame[3] == 7 and len(frame[5]) == max_frame - 12
    assert dec.buffered == 0
