"""The record batch codec (log/batch.py) and batch records (log/record.py): round trips,
every flipped byte detected, truncations refused, and the selection a pull's reader makes of
a batch record's messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.log.batch import (
    BATCH_HEAD_SIZE,
    MAX_BATCH_COUNT,
    batch_parts,
    build_batch_record_head,
    check_batch,
    encode_batch,
    encode_bodies_batch,
    slice_batch,
)
from onceq.log.record import (
    REC_HEADER_SIZE,
    RecordError,
    TruncatedRecord,
    build_record,
    check_record,
    decode_records,
    encode_part,
    first_mismatch,
    record_matches,
    slice_batch_record,
    tag_hash,
)

keys_st = st.text(alphabet="0123456789ABCDEF", min_size=0, max_size=40)
msg_st = st.fixed_dictionaries({
    "body": st.binary(max_size=300),
    "key": keys_st,
    "tags": st.sampled_from(["", "a", "b", "tagé"]),
    "keys": st.sampled_from(["", "order-1", "k1 k2"]),
    "props": st.sampled_from([None, {"x": "1"}, {"a": "b", "c": "é"}]),
    "recons": st.sampled_from([0, 0, 0, 2]),
})
batch_st = st.lists(msg_st, min_size=1, max_size=20)


def _parts(msgs: list[dict]) -> list[bytes]:
    return [encode_part(m["body"], m["key"], 1_000 + i, m["tags"], m["keys"], m["props"],
                        reconsume_times=m["recons"]) for i, m in enumerate(msgs)]


def _record(batch: bytes, base: int = 10, position: int = 0, topic: bytes = b"T",
            queue: int = 3) -> bytes:
    return build_batch_record_head(topic, queue, base, position, 5_000, len(batch)) + batch


@given(batch_st)
@settings(max_examples=150, deadline=None)
def test_batch_round_trip(msgs: list[dict]) -> None:
    batch = encode_batch(_parts(msgs))
    keys, hashes, max_body, flags = check_batch(batch)
    want_keys = [m["key"].encode() + (b"#%d" % m["recons"] if m["recons"] else b"")
                 for m in msgs]
    assert keys == want_keys
    assert hashes == [tag_hash(m["tags"]) for m in msgs]
    assert max_body == max(len(m["body"]) for m in msgs)
    assert flags == 0
    rec = _record(batch)
    head = check_record(rec, 0, 0)
    assert (head.size, head.queue_id, head.queue_offset, head.count) == (len(rec), 3, 10,
                                                                          len(msgs))
    assert list(head.messages()) == [(10 + i, k, h)
                                     for i, (k, h) in enumerate(zip(keys, hashes, strict=True))]
    got = list(decode_records(rec))
    assert [(m.queue_offset, m.body, m.unique_key, m.tags, m.keys, m.reconsume_times,
             m.topic, m.queue_id, m.store_ts_ms) for m in got] == [
        (10 + i, m["body"], m["key"], m["tags"], m["keys"], m["recons"], "T", 3, 5_000)
        for i, m in enumerate(msgs)]
    assert [m.properties for m in got] == [m["props"] or {} for m in msgs]


@given(batch_st, st.data())
@settings(max_examples=150, deadline=None)
def test_any_flipped_byte_is_detected(msgs: list[dict], data: st.DataObject) -> None:
    batch = encode_batch(_parts(msgs))
    i = data.draw(st.integers(0, len(batch) - 1))
    bad = bytearray(batch)
    bad[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(RecordError):
        check_batch(bytes(bad))
    rec = _record(batch)
    j = data.draw(st.integers(0, len(rec) - 1))
    bad = bytearray(rec)
    bad[j] ^= data.draw(st.integers(1, 255))
    with pytest.raises(RecordError):
        check_record(bytes(bad), 0, 0)
    assert not record_matches(bytes(bad), 0, len(rec), b"T", 3, 10, 0)
    with pytest.raises(RecordError):
        list(decode_records(bytes(bad)))


@given(batch_st, st.data())
@settings(max_examples=100, deadline=None)
def test_truncated_batches_are_refused(msgs: list[dict], data: st.DataObject) -> None:
    batch = encode_batch(_parts(msgs))
    k = data.draw(st.integers(0, len(batch) - 1))
    with pytest.raises(RecordError):
        check_batch(batch[:k])
    rec = _record(batch)
    k = data.draw(st.integers(0, len(rec) - 1))
    with pytest.raises(RecordError):  # TruncatedRecord is one (more bytes may come)
        check_record(rec[:k], 0, 0)
    if k:  # an empty payload is no record at all
        with pytest.raises(RecordError):
            list(decode_records(rec[:k]))


@given(batch_st, st.data())
@settings(max_examples=100, deadline=None)
def test_a_pull_keeps_the_offsets_and_tags_it_asked_for(msgs: list[dict],
                                                         data: st.DataObject) -> None:
    rec = _record(encode_batch(_parts(msgs)), base=100)
    n = len(msgs)
    first = data.draw(st.integers(95, 100 + n))
    end = data.draw(st.integers(first, 100 + n + 5))
    wanted = data.draw(st.sets(st.sampled_from(["", "a", "b", "tagé"])))
    hashes = frozenset(tag_hash(t) for t in wanted)
    got = [(m.queue_offset, m.body) for m in decode_records(rec, True, first, end, hashes)]
    assert got == [(100 + i, m["body"]) for i, m in enumerate(msgs)
                   if first <= 100 + i < end and m["tags"] in wanted]


def test_a_record_matches_every_offset_it_holds_and_no_other() -> None:
    rec = _record(encode_batch(_parts([{"body": b"x", "key": f"K{i}", "tags": "",
                                        "keys": "", "props": None, "recons": 0}
                                       for i in range(5)])), base=7, position=4096)
    for off in range(7, 12):
        assert record_matches(rec, 0, len(rec), b"T", 3, off, 4096)
    for off, topic, queue, pos in ((6, b"T", 3, 4096), (12, b"T", 3, 4096),
                                   (7, b"U", 3, 4096), (7, b"T", 2, 4096), (7, b"T", 3, 0)):
        assert not record_matches(rec, 0, len(rec), topic, queue, off, pos)
    single = build_record(b"T", 3, 12, 4096 + len(rec), 5_000, encode_part(b"y", "S", 1))
    both = rec + single
    assert first_mismatch(both, [(9, 4096, len(rec)), (12, 4096 + len(rec), len(single))],
                          b"T", 3) == -1
    assert first_mismatch(both, [(12, 4096, len(rec)), (12, 4096 + len(rec), len(single))],
                          b"T", 3) == 0
    # a payload with a single record after a batch record decodes both kinds
    assert [m.queue_offset for m in decode_records(both, True, 9, 13)] == [9, 10, 11, 12]


def test_malformed_batches_say_what_is_wrong() -> None:
    part = encode_part(b"body", "K", 1)
    good = encode_batch([part, part])
    cases = {
        "too short": good[:BATCH_HEAD_SIZE - 1],
        "magic": good[:8] + b"\x00" + good[9:],
        "size": good + b"\x00",
        "attributes": good[:9] + b"\x01" + good[10:],
    }
    for what, raw in cases.items():
        with pytest.raises(RecordError):
            check_batch(raw)
        assert what
    with pytest.raises(RecordError, match="too short for 3 messages"):
        bad = bytearray(encode_batch([part, part]))
        bad[10] = 3  # count, then a fresh checksum: the parts do not add up
        import zlib
        bad[4:8] = zlib.crc32(bytes(bad[8:])).to_bytes(4, "little")
        check_batch(bytes(bad))
    with pytest.raises(RecordError):
        encode_batch([])
    with pytest.raises(RecordError):
        encode_batch([part] * (MAX_BATCH_COUNT + 1))


@given(batch_st, st.sampled_from(["none", "zstd", "lz4"]))
@settings(max_examples=50, deadline=None)
def test_batch_parts_give_back_the_parts_sent(msgs: list[dict], compression: str) -> None:
    parts = _parts(msgs)
    assert batch_parts(encode_batch(parts, compression)) == parts


def test_a_truncated_batch_record_may_be_completed() -> None:
    rec = _record(encode_batch([encode_part(b"x", "K", 1)]))
    with pytest.raises(TruncatedRecord):
        check_record(rec[:REC_HEADER_SIZE + 3], 0, 0)


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@given(msgs=batch_st)
@settings(max_examples=40, deadline=None)
def test_compressed_batches_round_trip_and_are_checked(compression: str,
                                                       msgs: list[dict]) -> None:
    parts = _parts(msgs)
    batch = encode_batch(parts, compression)
    assert batch[9] == {"zstd": 1, "lz4": 2}[compression]
    assert check_batch(batch)[:2] == check_batch(encode_batch(parts))[:2]
    rec = _record(batch)
    assert check_record(rec, 0, 0).count == len(msgs)
    assert [m.body for m in decode_records(rec, True, 11)] == [m["body"] for m in msgs[1:]]


def test_a_compressed_batch_that_lies_about_its_size_is_refused() -> None:
    import zlib

    import zstandard

    plain = b"".join(_parts([{"body": b"x" * 100, "key": "K", "tags": "", "keys": "",
                             "props": None, "recons": 0}] * 3))
    for frame, why in (
            (zstandard.ZstdCompressor(write_content_size=False).compress(plain), "state"),
            (b"not a frame at all", "decompress"),
            (zstandard.ZstdCompressor().compress(plain + b"extra"), "do not add up")):
        tail = bytes([0xB1, 1, 3, 0])
        body = tail + frame
        batch = (len(body) + 8).to_bytes(4, "little") + zlib.crc32(body).to_bytes(
            4, "little") + body
        with pytest.raises(RecordError, match=why):
            check_batch(batch)
    with pytest.raises(RecordError, match="unknown compression"):
        encode_batch([plain], "gzip")


@given(st.lists(st.tuples(st.binary(max_size=200), keys_st), min_size=1, max_size=30),
       st.integers(-2**63, 2**63 - 1), st.sampled_from(["none", "zstd"]))
def test_a_batch_of_bodies_is_the_batch_of_their_parts(items: list[tuple[bytes, str]],
                                                       born: int, compression: str) -> None:
    bodies = [b for b, _k in items]
    keys = [k for _b, k in items]
    assert encode_bodies_batch(bodies, keys, born, compression) == encode_batch(
        [encode_part(b, k, born) for b, k in items], compression)
    with pytest.raises(RecordError):
        encode_bodies_batch([b"x"], ["é"], born)
    with pytest.raises(RecordError):
        encode_bodies_batch([b"x"], ["K" * 256], born)


@given(batch_st, st.sampled_from(["none", "lz4"]), st.data())
@settings(max_examples=80, deadline=None)
def test_a_slice_of_a_batch_is_the_batch_of_those_parts(msgs: list[dict], compression: str,
                                                       data: st.DataObject) -> None:
    parts = _parts(msgs)
    a = data.draw(st.integers(0, len(parts) - 1))
    b = data.draw(st.integers(a + 1, len(parts)))
    assert slice_batch(encode_batch(parts, compression), a, b) == encode_batch(parts[a:b])
    rec = _record(encode_batch(parts, compression), base=50)
    cut = slice_batch_record(rec, 0, 50 + a, 50 + b)
    if 2 * (b - a) >= len(parts):
        assert cut is None  # half or more wanted: sent as stored
    else:
        assert cut is not None and check_record(cut, 0, 0).count == b - a
        assert [(m.queue_offset, m.body) for m in decode_records(cut)] == [
            (50 + i, msgs[i]["body"]) for i in range(a, b)]
