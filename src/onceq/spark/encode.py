"""Rows of the sink's input (Arrow) as message parts, column by column.

The sink's hot path: a chunk of rows becomes the payload of one sequenced send
(``[u32 length][part]`` per message, ``log/record.py``) with Arrow compute and numpy, not a
Python loop per row (msgpack maps of the properties included).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..log.record import PART_FIXED_SIZE, encode_part
from ..log.sequence import SEQ_PROPERTY, SEQUENCED, marker

# [u32 part length] + the part's fixed header, little endian, no padding
_HEAD = np.dtype([("size", "<u4"), ("born", "<i8"), ("flags", "<u2"), ("recons", "<u2"),
                  ("ulen", "u1"), ("tlen", "<u2"), ("klen", "<u2"), ("plen", "<u4"),
                  ("blen", "<u4")])
assert _HEAD.itemsize == 4 + PART_FIXED_SIZE
_EMPTY = pa.scalar(b"", pa.binary())


def _binary(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    """A column as binary with nulls as empty (None when absent)."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        return None
    col = batch.column(i)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        # Spark's arrays may say "element not null": binary_join wants the plain type
        col = col.cast(pa.list_(pa.string()))
        if pc.list_flatten(col).null_count:  # binary_join would make the whole row null
            col = pa.array([None if v is None else [x for x in v if x is not None]
                            for v in col.to_pylist()], pa.list_(pa.string()))
        col = pc.binary_join(col, " ")
    if not pa.types.is_binary(col.type):
        col = col.cast(pa.binary())
    return pc.fill_null(col, _EMPTY) if col.null_count else col


def _msgpack_headers(values: np.ndarray, fix_limit: int, fix_base: int,
                     wide: Sequence[tuple[int, int, int]]) -> pa.Array:
    """msgpack length headers, one per value: ``fix_base | v`` below ``fix_limit``, else
    the first ``(limit, code, width)`` the value is below (big-endian ``width`` bytes)."""
    v = values.astype(np.int64)
    m = len(v)
    out = np.zeros((m, 5), dtype=np.uint8)
    sizes = np.ones(m, dtype=np.int32)
    done = v < fix_limit
    out[done, 0] = fix_base | v[done]
    for limit, code, width in wide:
        sel = ~done & (v < limit)
        out[sel, 0] = code
        for b in range(width):
            out[sel, 1 + b] = (v[sel] >> (8 * (width - 1 - b))) & 0xFF
        sizes[sel] = 1 + width
        done |= sel
    offsets = np.zeros(m + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    data = out[np.arange(5) < sizes[:, None]]
    return pa.BinaryArray.from_buffers(pa.binary(), m, [None, pa.py_buffer(offsets),
                                                        pa.py_buffer(data.tobytes())])


_STR = (32, 0xA0, ((256, 0xD9, 1), (65536, 0xDA, 2), (2 ** 32, 0xDB, 4)))
_MAP = (16, 0x80, ((65536, 0xDE, 2), (2 ** 32, 0xDF, 4)))
_NIL = pa.scalar(b"\xc0", pa.binary())


def _properties(batch: pa.RecordBatch) -> pa.Array | None:
    """The properties map column as msgpack maps (what ``encode_part`` packs), built from
    the flattened keys and values; an empty or null map is no properties."""
    i = batch.schema.get_field_index("properties")
    if i < 0:
        return None
    col = batch.column(i)
    offs = col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    lo, hi = int(offs[0]), int(offs[-1])
    counts = np.diff(offs)
    keys = col.keys.slice(lo, hi - lo).cast(pa.binary())
    items = col.items.slice(lo, hi - lo).cast(pa.binary())
    khead = _msgpack_headers(_lengths(keys, hi - lo), *_STR)
    vhead = _msgpack_headers(_lengths(pc.fill_null(items, _EMPTY), hi - lo), *_STR)
    if items.null_count:
        vhead = pc.if_else(items.is_null(), _NIL, vhead)
    entries = pc.binary_join_element_wise(khead, keys, vhead, pc.fill_null(items, _EMPTY),
                                          b"")
    rows = pa.ListArray.from_arrays(pa.array(offs - lo, pa.int32()), entries)
    packed = pc.binary_join_element_wise(_msgpack_headers(counts, *_MAP),
                                         pc.binary_join(rows, _EMPTY), b"")
    keep = pa.array(counts > 0) if not col.null_count else pc.and_(
        pa.array(counts > 0), pc.is_valid(col))
    return pc.if_else(keep, packed, _EMPTY)


def _lengths(col: pa.Array | None, n: int) -> np.ndarray:
    if col is None:
        return np.zeros(n, dtype=np.int64)
    return pc.binary_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def encode_chunk(rows: pa.RecordBatch, writer: str, epoch: int, seq: int, key_prefix: str,
                 born_ms: int | None = None) -> bytes:
    """The payload of one sequenced send of ``rows`` (numbered ``seq, seq+1, ...``): unique
    keys ``<key_prefix><seq>``; the last message carries the batch's sequence."""
    n = rows.num_rows
    born = int(time.time() * 1000) if born_ms is None else born_ms
    i = rows.schema.get_field_index("body")
    assert i >= 0 and n > 0
    if rows.column(i).null_count:  # (before _binary makes nulls empty)
        raise ValueError("onceq sink: a row has a null body")
    body = _binary(rows, "body")
    assert body is not None
    numbers = pa.array(np.arange(seq, seq + n, dtype=np.int64)).cast(pa.string())
    keys = pc.binary_join_element_wise(pa.scalar(key_prefix.encode()), numbers.cast(pa.binary()),
                                       b"")
    tags, ks, props = _binary(rows, "tags"), _binary(rows, "keys"), _properties(rows)
    cols = [c for c in (keys, tags, ks, props) if c is not None] + [body]
    head = np.zeros(n, dtype=_HEAD)
    lens = {name: _lengths(c, n) for name, c in
            (("ulen", keys), ("tlen", tags), ("klen", ks), ("plen", props), ("blen", body))}
    if lens["tlen"].max(initial=0) > 65535 or lens["klen"].max(initial=0) > 65535:
        raise ValueError("onceq sink: tags or keys longer than 65535 bytes")
    for name, v in lens.items():
        head[name] = v
    head["born"] = born
    head["size"] = PART_FIXED_SIZE + sum(lens.values())
    head_col = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(_HEAD.itemsize), n - 1, [None, pa.py_buffer(head[:-1].tobytes())])
    out = b""
    if n > 1:
        joined = pc.binary_join_element_wise(head_col.cast(pa.binary()),
                                             *[c.slice(0, n - 1) for c in cols], b"")
        offsets = joined.buffers()[1]
        start, end = np.frombuffer(offsets, dtype=np.int32, count=n, offset=joined.offset * 4
                                   )[[0, n - 1]]
        out = joined.buffers()[2].to_pybytes()[start:end]
    # the last message: its properties carry the sequence (and its flag marks it)
    last = n - 1
    p = rows.schema.get_field_index("properties")
    user = rows.column(p)[last].as_py() if p >= 0 else None
    extra = {**(dict(user) if user else {}), SEQ_PROPERTY: marker(writer, epoch, seq + last)}
    part = encode_part(body[last].as_py(), f"{key_prefix}{seq + last}", born,
                       tags[last].as_py().decode() if tags is not None else "",
                       ks[last].as_py().decode() if ks is not None else "", extra, SEQUENCED)
    return b"".join((out, len(part).to_bytes(4, "little"), part))


def route(rows: pa.RecordBatch, queues: int, partition: int, first_row: int, size: int
          ) -> np.ndarray:
    """The queue of each row: its ``queue`` column, else the hash of its ``sharding_key``
    (as the producer picks it), else ``(partition + row index // size) % queues``."""
    n = rows.num_rows
    out = (partition + (np.arange(first_row, first_row + n) // size)) % queues
    i = rows.schema.get_field_index("sharding_key")
    if i >= 0:
        col = rows.column(i)
        if col.null_count < n:
            for j, s in enumerate(col.to_pylist()):
                if s is not None:
                    out[j] = zlib.crc32(s.encode()) % queues
    i = rows.schema.get_field_index("queue")
    if i >= 0:
        col = rows.column(i)
        if col.null_count < n:
            given = col.to_numpy(zero_copy_only=False)
            mask = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            bad = mask & ((given < 0) | (given >= queues))
            if bad.any():
                j = int(np.argmax(bad))
                raise ValueError(f"onceq sink: row {first_row + j} names queue "
                                 f"{int(given[j])}; the topic has {queues} queues")
            out[mask] = given[mask]
    return out


def split_by_queue(rows: pa.RecordBatch, targets: np.ndarray) -> Sequence[
        tuple[int, pa.RecordBatch]]:
    """``rows`` grouped by target queue, keeping their order within each queue."""
    qs = np.unique(targets)
    if len(qs) == 1:
        return [(int(qs[0]), rows)]
    return [(int(q), rows.take(pa.array(np.nonzero(targets == q)[0]))) for q in qs]
