"""Message part and commit-log record codecs."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.log.record import (
    MIN_PART_SIZE,
    REC_HEADER_SIZE,
    RecordError,
    TruncatedRecord,
    build_record,
    check_record,
    decode_records,
    encode_part,
    part_unique_key_and_tags,
    tag_hash,
)

ascii_key = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=255
)
short_text = st.text(max_size=40)  # any unicode, incl. astral and NUL
props_st = st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=5)
topic_st = st.text(alphabet="abcXYZ019_-.%|", min_size=1, max_size=127)


@st.composite
def messages(draw):
    return {
        "body": draw(st.binary(max_size=600)),
        "unique_key": draw(ascii_key),
        "born_ts_ms": draw(st.integers(-(2**63), 2**63 - 1)),
        "tags": draw(short_text),
        "keys": draw(short_text),
        "properties": draw(props_st),
        "flags": draw(st.integers(0, 0xFFFF)),
        "reconsume_times": draw(st.integers(0, 0xFFFF)),
    }


@st.composite
def placements(draw):
    return {
        "topic": draw(topic_st),
        "queue_id": draw(st.integers(0, 0xFFFF)),
        "queue_offset": draw(st.integers(0, 2**63 - 1)),
        "position": draw(st.integers(0, 2**63 - 1)),
        "store_ts_ms": draw(st.integers(-(2**63), 2**63 - 1)),
    }


def _record(m: dict, pl: dict) -> bytes:
    part = encode_part(**m)
    return build_record(pl["topic"].encode(), pl["queue_id"], pl["queue_offset"],
                        pl["position"], pl["store_ts_ms"], part)


def _assert_message(msg, m: dict, pl: dict) -> None:
    assert msg.topic == pl["topic"]
    assert msg.queue_id == pl["queue_id"]
    assert msg.queue_offset == pl["queue_offset"]
    assert msg.position == pl["position"]
    assert msg.store_ts_ms == pl["store_ts_ms"]
    assert msg.body == m["body"] and isinstance(msg.body, bytes)
    assert msg.unique_key == m["unique_key"]
    assert msg.born_ts_ms == m["born_ts_ms"]
    assert msg.tags == m["tags"]
    assert msg.keys == m["keys"]
    assert msg.properties == m["properties"]
    assert msg.flags == m["flags"]
    assert msg.reconsume_times == m["reconsume_times"]


# ------------------------------------------------------------------ round trip
@settings(max_examples=150, deadline=None)
@given(messages(), placements())
def test_round_trip(m, pl):
    part = encode_part(**m)
    uk, tags, blen = part_unique_key_and_tags(part)
    assert uk == m["unique_key"].encode()
    assert tags == m["tags"].encode()
    assert blen == len(m["body"])
    rec = _record(m, pl)
    assert len(rec) == REC_HEADER_SIZE + len(pl["topic"]) + len(part)
    [msg] = list(decode_records(rec))
    _assert_message(msg, m, pl)
    head = check_record(rec, 0, pl["position"])
    assert head.size == len(rec)
    assert (head.queue_id, head.queue_offset, head.position, head.store_ts_ms) == (
        pl["queue_id"], pl["queue_offset"], pl["position"], pl["store_ts_ms"])
    assert head.topic == pl["topic"]
    assert head.unique_key == m["unique_key"].encode()
    assert head.tags_hash == tag_hash(m["tags"])
    # a record embedded in a larger buffer, and memoryview input
    buf = b"junk" + rec + b"tail"
    assert check_record(memoryview(buf), 4, pl["position"]).size == len(rec)
    assert part_unique_key_and_tags(memoryview(part)) == (uk, tags, blen)


def test_minimal_part():
    part = encode_part(b"", "", 0)
    assert len(part) == MIN_PART_SIZE
    assert part_unique_key_and_tags(part) == (b"", b"", 0)
    [msg] = decode_records(build_record(b"t", 0, 0, 0, 0, part))
    assert (msg.body, msg.unique_key, msg.tags, msg.keys, msg.properties) == (b"", "", "", "",
                                                                             {})


def test_key_list_splits_keys():
    [msg] = decode_records(build_record(b"t", 0, 0, 0, 0,
                                        encode_part(b"x", "u", 1, keys="a  b c")))
    assert msg.key_list == ["a", "b", "c"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(messages(), placements()), min_size=1, max_size=8))
def test_concatenated_records_decode_in_order(items):
    buf = b"".join(_record(m, pl) for m, pl in items)
    got = list(decode_records(buf))
    assert len(got) == len(items)
    for msg, (m, pl) in zip(got, items, strict=True):
        _assert_message(msg, m, pl)
    # check_record walks the same buffer record by record
    pos = 0
    for _m, pl in items:
        head = check_record(buf, pos, pl["position"])
        pos += head.size
    assert pos == len(buf)


def test_decode_empty_buffer():
    assert list(decode_records(b"")) == []


# ------------------------------------------------------------------ encode errors
def test_encode_part_limits():
    encode_part(b"", "k" * 255, 0)
    with pytest.raises(RecordError):
        encode_part(b"", "k" * 256, 0)
    with pytest.raises(RecordError):
        encode_part(b"", "é", 0)  # unique keys are ascii
    with pytest.raises(RecordError):
        encode_part(b"", "k", 0, tags="t" * 65536)
    with pytest.raises(RecordError):
        encode_part(b"", "k", 0, keys="é" * 40000)
    encode_part(b"", "k", 0, tags="t" * 65535, keys="k" * 65535)


def test_tag_hash():
    assert tag_hash("") == 0 and tag_hash(b"") == 0
    assert tag_hash("TagA") == tag_hash(b"TagA") != 0
    assert tag_hash("TagA") != tag_hash("TagB")
    assert tag_hash("ü") == tag_hash("ü".encode())


# ------------------------------------------------------------------ corruption
@settings(max_examples=200, deadline=None)
@given(messages(), placements(), st.data())
def test_single_byte_corruption_is_detected(m, pl, data):
    rec = bytearray(_record(m, pl))
    i = data.draw(st.integers(0, len(rec) - 1), label="index")
    rec[i] ^= data.draw(st.integers(1, 255), label="xor")
    bad = bytes(rec)
    with pytest.raises(RecordError):
        check_record(bad, 0, pl["position"])
    with pytest.raises(RecordError):
        list(decode_records(bad))
    # also when more bytes follow (the size field may now claim them)
    with pytest.raises(RecordError):
        check_record(bad + bytes(300), 0, pl["position"])


@settings(max_examples=100, deadline=None)
@given(messages(), placements(), st.data())
def test_truncated_record(m, pl, data):
    rec = _record(m, pl)
    cut = data.draw(st.integers(0, len(rec) - 1))
    with pytest.raises(TruncatedRecord):
        check_record(rec[:cut], 0, pl["position"])
    if cut:
        with pytest.raises(RecordError):
            list(decode_records(rec[:cut]))


def test_record_position_mismatch():
    rec = build_record(b"t", 0, 0, 100, 0, encode_part(b"x", "u", 1))
    check_record(rec, 0, 100)
    with pytest.raises(RecordError) as ei:
        check_record(rec, 0, 101)
    assert not isinstance(ei.value, TruncatedRecord)


def test_zeroed_buffer_is_not_a_record():
    with pytest.raises(RecordError):
        check_record(bytes(200), 0, 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decode_records_garbage_raises_only_record_error(garbage):
    for verify in (True, False):
        with contextlib.suppress(RecordError):
            list(decode_records(garbage, verify=verify))


@settings(max_examples=200, deadline=None)
@given(messages(), placements(), st.data())
def test_unverified_decode_of_corrupt_record_raises_only_record_error(m, pl, data):
    rec = bytearray(_record(m, pl))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(rec) - 1))
        rec[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(RecordError):
        list(decode_records(bytes(rec), verify=False))


# ------------------------------------------------------------------ part validation
@settings(max_examples=150, deadline=None)
@given(messages(), st.data())
def test_part_with_wrong_size_is_rejected(m, data):
    part = encode_part(**m)
    if data.draw(st.booleans(), label="truncate"):
        bad = part[: data.draw(st.integers(0, len(part) - 1), label="cut")]
    else:
        bad = part + data.draw(st.binary(min_size=1, max_size=40), label="extra")
    with pytest.raises(RecordError):
        part_unique_key_and_tags(bad)


@settings(max_examples=200, deadline=None)
@given(messages(), st.data())
def test_part_length_fields_mutated(m, data):
    """Mutating a length field either is rejected or still describes the whole part."""
    part = bytearray(encode_part(**m))
    # length fields of the fixed part header: unique key, tags, keys, properties, body
    fields = [(12, "<B"), (13, "<H"), (15, "<H"), (17, "<I"), (21, "<I")]
    off, fmt = data.draw(st.sampled_from(fields))
    old = struct.unpack_from(fmt, part, off)[0]
    new = data.draw(st.integers(0, 2 ** (8 * struct.calcsize(fmt)) - 1).filter(
        lambda v: v != old))
    struct.pack_into(fmt, part, off, new)
    with pytest.raises(RecordError):
        part_unique_key_and_tags(bytes(part))


def _raw_part(uk: bytes = b"k", tags: bytes = b"", keys: bytes = b"", props: bytes = b"",
              body: bytes = b"b") -> bytes:
    head = struct.pack("<qHHBHHII", 1, 0, 0, len(uk), len(tags), len(keys), len(props),
                       len(body))
    return b"".join((head, uk, tags, keys, props, body))


def test_raw_part_helper_matches_encoder():
    assert _raw_part(b"u", b"t", b"k", msgpack.packb({"a": "b"}), b"xy") == encode_part(
        b"xy", "u", 1, tags="t", keys="k", properties={"a": "b"})


@pytest.mark.parametrize(
    "part",
    [
        _raw_part(uk=b"\xff\xfe"),  # unique key must be ascii
        _raw_part(tags=b"\xc3"),  # tags must be utf-8
        _raw_part(keys=b"\xff"),  # keys must be utf-8
        _raw_part(props=b"\xc1"),  # properties must be msgpack
        _raw_part(props=msgpack.packb([1, 2])),  # ... a map
        _raw_part(props=msgpack.packb({1: "a"})),  # ... with string keys
        _raw_part(props=msgpack.packb({"a": "b"}) + b"\x00"),  # ... and nothing else
    ],
    ids=["uk-not-ascii", "tags-not-utf8", "keys-not-utf8", "props-junk", "props-list",
         "props-int-key", "props-extra"],
)
def test_part_content_that_consumers_cannot_decode_is_rejected(part):
    with pytest.raises(RecordError):
        part_unique_key_and_tags(part)
