"""Stored records into Arrow record batches (needs the spark extra's pyarrow)."""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow")

from onceq.log.record import RecordError, build_record, decode_records, encode_part
from onceq.spark.arrow import ARROW_SCHEMA, records_to_batch, to_record_batch


def _payload(n: int) -> bytes:
    return b"".join(
        build_record(b"orders", 3, 10 + i, 1000 * i, 1_700_000_000_000 + i,
                     encode_part(f"body {i}".encode(), f"UK{i:04d}", 1_699_999_999_000 + i,
                                 tags="T" if i % 2 else "", keys=f"k{i} o{i % 3}",
                                 properties={"i": str(i)} if i % 3 else None,
                                 reconsume_times=i % 4))
        for i in range(n))


def test_columns_decoded_in_place_equal_the_message_path():
    payload = _payload(50)
    batch = records_to_batch(payload, True, 1 << 62)
    assert batch.schema == ARROW_SCHEMA
    assert batch.equals(to_record_batch(list(decode_records(payload))))
    row = batch.slice(7, 1).to_pylist()[0]
    assert row["offset"] == 17 and row["queue"] == 3 and row["properties"] == [("i", "7")]
    assert row["reconsume_count"] == 3 and row["keys"] == "k7 o1" and row["tags"] == "T"


def test_rows_at_or_past_the_end_are_left_out():
    batch = records_to_batch(_payload(50), True, 30)
    assert batch.column("offset").to_pylist() == list(range(10, 30))
    assert records_to_batch(_payload(5), True, 10).num_rows == 0


def test_a_damaged_record_raises():
    payload = bytearray(_payload(3))
    payload[60] ^= 0xFF
    with pytest.raises(RecordError):
        records_to_batch(bytes(payload), True, 1 << 62)


def test_batch_records_give_only_the_pulled_rows_and_a_bad_size_is_an_error():
    from onceq.log.batch import build_batch_record_head, encode_batch
    from onceq.log.record import REC_HEADER

    batch = encode_batch([encode_part(b"b%d" % i, f"K{i}", 1) for i in range(10)])
    rec = build_batch_record_head(b"t", 0, 100, 0, 5, len(batch)) + batch
    rows = records_to_batch(rec, True, 107, 103).to_pydict()
    assert rows["offset"] == [103, 104, 105, 106]
    assert rows["body"] == [b"b3", b"b4", b"b5", b"b6"] and rows["topic"] == ["t"] * 4
    bad = bytearray(rec)
    REC_HEADER.pack_into(bad, 0, 0, *REC_HEADER.unpack_from(rec)[1:])  # total_size 0
    with pytest.raises(RecordError):
        records_to_batch(bytes(bad), False, 200, 0)
