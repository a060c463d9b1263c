"""The sink's column-wise encoding equals the message-by-message one (needs pyarrow)."""

from __future__ import annotations

import zlib

import pytest

pytest.importorskip("pyarrow")

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.client.sequenced import encode_sequenced
from onceq.spark.encode import encode_chunk, route, split_by_queue

SCHEMA = pa.schema([("body", pa.binary()), ("tags", pa.string()),
                    ("keys", pa.list_(pa.string())),
                    ("properties", pa.map_(pa.string(), pa.string()))])
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
row = st.tuples(st.binary(max_size=40), st.none() | text,
                st.none() | st.lists(text.filter(lambda s: s and " " not in s), max_size=3),
                st.none() | st.dictionaries(text, text, max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.lists(row, min_size=1, max_size=30), st.integers(0, 2 ** 40),
       st.integers(0, 2 ** 40), st.booleans())
def test_encode_chunk_equals_encode_sequenced(rows, epoch, seq, all_columns):
    cols = {"body": [r[0] for r in rows], "tags": [r[1] for r in rows],
            "keys": [r[2] for r in rows], "properties": [r[3] for r in rows]}
    schema = SCHEMA if all_columns else pa.schema([SCHEMA.field("body")])
    batch = pa.RecordBatch.from_pydict({k: cols[k] for k in schema.names}, schema=schema)
    got = encode_chunk(batch, "query/1", epoch, seq, "pre-", born_ms=7)
    want = encode_sequenced("query/1", epoch, seq, [
        (b, f"pre-{seq + i}", (t or "") if all_columns else "",
         " ".join(k) if all_columns and k else "", (p or None) if all_columns else None)
        for i, (b, t, k, p) in enumerate(rows)], 7)
    assert got == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.none() | st.dictionaries(
    st.text(min_size=0, max_size=300), st.none() | st.text(max_size=70000), max_size=20),
    min_size=2, max_size=6), st.integers(0, 3))
def test_properties_of_every_msgpack_size(maps, cut):
    """Long keys and values (str8/16/32), 16+ entries (map16), null values (nil), and a
    sliced column (Spark hands over slices)."""
    col = pa.array([None] * cut + maps, type=pa.map_(pa.string(), pa.string())).slice(cut)
    batch = pa.RecordBatch.from_arrays([pa.array([b"b"] * len(maps)), col],
                                       names=["body", "properties"])
    want = encode_sequenced("w", 1, 0, [(b"b", f"u{i}", "", "", m or None)
                                        for i, m in enumerate(maps)], 3)
    assert encode_chunk(batch, "w", 1, 0, "u", born_ms=3) == want


def test_keys_array_of_non_null_strings():
    keys = pa.array([["a", "b"], None, []], type=pa.list_(pa.field("e", pa.string(), False)))
    batch = pa.RecordBatch.from_arrays([pa.array([b"x"] * 3), keys], names=["body", "keys"])
    want = encode_sequenced("w", 0, 0, [(b"x", "p0", "", "a b", None), (b"x", "p1", "", "", None),
                                        (b"x", "p2", "", "", None)], 1)
    assert encode_chunk(batch, "w", 0, 0, "p", born_ms=1) == want


def test_null_keys_in_an_array_are_left_out_and_a_null_body_is_refused():
    keys = pa.array([["a", None, "b"], [None]], type=pa.list_(pa.string()))
    batch = pa.RecordBatch.from_arrays([pa.array([b"x"] * 2), keys], names=["body", "keys"])
    want = encode_sequenced("w", 0, 0, [(b"x", "p0", "", "a b", None),
                                        (b"x", "p1", "", "", None)], 1)
    assert encode_chunk(batch, "w", 0, 0, "p", born_ms=1) == want
    nulls = pa.RecordBatch.from_arrays([pa.array([b"x", None])], names=["body"])
    with pytest.raises(ValueError, match="null body"):
        encode_chunk(nulls, "w", 0, 0, "p", born_ms=1)


def test_route_and_split():
    batch = pa.RecordBatch.from_pydict({
        "body": [b"a"] * 6, "queue": [None, 2, None, None, 0, None],
        "sharding_key": [None, "x", "order-7", None, None, None]})
    targets = route(batch, 3, partition=1, first_row=4, size=2)
    assert list(targets) == [(1 + 4 // 2) % 3, 2, zlib.crc32(b"order-7") % 3,
                             (1 + 7 // 2) % 3, 0, (1 + 9 // 2) % 3]
    parts = split_by_queue(batch, targets)
    assert sorted(q for q, _ in parts) == sorted(set(targets.tolist()))
    for q, b in parts:
        assert b.num_rows == int(np.sum(targets == q))
    with pytest.raises(ValueError, match="names queue 3"):
        route(pa.RecordBatch.from_pydict({"body": [b"a"], "queue": [3]}), 3, 0, 0, 10)
