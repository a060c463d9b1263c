"""The rows the source yields: the Spark schema and messages as Arrow record batches."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgpack
import numpy as np
import pyarrow as pa

from ..client.message import MessageExt
from ..log.batch import BATCH_RECORD_MAGIC
from ..log.record import (
    PART_FIXED_SIZE,
    REC_HEAD_AND_PART,
    REC_HEADER_SIZE,
    RECORD_MAGIC,
    RecordError,
    decode_records,
)

SCHEMA_DDL = (
    "body BINARY, keys STRING, tags STRING, properties MAP<STRING, STRING>, "
    "unique_key STRING, topic STRING, queue INT, offset BIGINT, "
    "born_timestamp TIMESTAMP, store_timestamp TIMESTAMP, reconsume_count INT"
)

# Spark checks a yielded batch against its schema exactly: BINARY is binary (not
# large_binary), INT int32, BIGINT int64, TIMESTAMP microseconds in UTC.
ARROW_SCHEMA = pa.schema([
    ("body", pa.binary()),
    ("keys", pa.string()),
    ("tags", pa.string()),
    ("properties", pa.map_(pa.string(), pa.string())),
    ("unique_key", pa.string()),
    ("topic", pa.string()),
    ("queue", pa.int32()),
    ("offset", pa.int64()),
    ("born_timestamp", pa.timestamp("us", tz="UTC")),
    ("store_timestamp", pa.timestamp("us", tz="UTC")),
    ("reconsume_count", pa.int32()),
])


def _micros(ms: list[int]) -> pa.Array:
    return pa.array(np.asarray(ms, dtype=np.int64) * 1000, type=pa.timestamp("us", tz="UTC"))


def to_record_batch(messages: Sequence[MessageExt]) -> pa.RecordBatch:
    """One record batch, in the order given."""
    return pa.RecordBatch.from_arrays([
        pa.array([m.body for m in messages], type=pa.binary()),
        pa.array([m.keys for m in messages], type=pa.string()),
        pa.array([m.tags for m in messages], type=pa.string()),
        pa.array([[(str(k), str(v)) for k, v in m.properties.items()] for m in messages],
                 type=pa.map_(pa.string(), pa.string())),
        pa.array([m.unique_key for m in messages], type=pa.string()),
        pa.array([m.topic for m in messages], type=pa.string()),
        pa.array([m.queue_id for m in messages], type=pa.int32()),
        pa.array([m.queue_offset for m in messages], type=pa.int64()),
        _micros([m.born_ts_ms for m in messages]),
        _micros([m.store_ts_ms for m in messages]),
        pa.array([m.reconsume_times for m in messages], type=pa.int32()),
    ], schema=ARROW_SCHEMA)


def records_to_batch(payload: bytes, verify: bool, end: int, start: int = 0
                     ) -> pa.RecordBatch:
    """Stored records (a pull's payload, one queue, ascending offsets) straight into one
    record batch, the rows in [``start``, ``end``) only: the columns of single records are
    filled while the records are decoded, without a message object per row (a batch
    record's messages go through ``decode_records``). Raises RecordError as
    ``decode_records`` does."""
    mv = memoryview(payload)
    n = len(mv)
    pos = 0
    unpack = REC_HEAD_AND_PART.unpack_from
    head_size = REC_HEADER_SIZE + PART_FIXED_SIZE
    crc32 = zlib.crc32
    unpackb = msgpack.unpackb
    bodies, keys, tags, props, uks, queues, offsets, born, stored, recons = (
        [], [], [], [], [], [], [], [], [], [])
    topic_raw, topic = b"", ""
    while pos < n:
        if n - pos < head_size:
            raise RecordError("truncated record header")
        (total, crc, magic, _r, qid, qoff, _rpos, sts, tlen,
         bts, _flags, rc, ulen, tgl, kl, pl, bl) = unpack(mv, pos)
        end_pos = pos + total
        if magic == BATCH_RECORD_MAGIC:
            if total <= REC_HEADER_SIZE or end_pos > n:
                raise RecordError("malformed record")
            if qoff >= end:
                break
            for m in decode_records(mv[pos:end_pos], verify, start, end):
                bodies.append(m.body)
                keys.append(m.keys)
                tags.append(m.tags)
                props.append([(str(k), str(v)) for k, v in m.properties.items()])
                uks.append(m.unique_key)
                queues.append(m.queue_id)
                offsets.append(m.queue_offset)
                born.append(m.born_ts_ms)
                stored.append(m.store_ts_ms)
                recons.append(m.reconsume_times)
                topic = m.topic
            pos = end_pos
            continue
        if (magic != RECORD_MAGIC or end_pos > n
                or total != head_size + ulen + tgl + kl + pl + bl + tlen):
            raise RecordError("malformed record")
        if qoff >= end:
            break
        if verify and crc32(mv[pos + 8:end_pos]) != crc:
            raise RecordError("record checksum mismatch")
        try:
            p = pos + head_size
            uks.append(str(mv[p:p + ulen], "ascii"))
            p += ulen
            tags.append(str(mv[p:p + tgl], "utf-8") if tgl else "")
            p += tgl
            keys.append(str(mv[p:p + kl], "utf-8") if kl else "")
            p += kl
            props.append([(str(k), str(v)) for k, v in unpackb(mv[p:p + pl], raw=False).items()]
                         if pl else [])
            p += pl
            bodies.append(bytes(mv[p:p + bl]))
            p += bl
            raw_topic = mv[p:end_pos]
            if raw_topic != topic_raw:
                topic_raw = bytes(raw_topic)
                topic = topic_raw.decode("ascii")
        except Exception as exc:  # a corrupt record read without verification
            raise RecordError(f"undecodable record: {exc}") from exc
        queues.append(qid)
        offsets.append(qoff)
        born.append(bts)
        stored.append(sts)
        recons.append(rc)
        pos = end_pos
    return pa.RecordBatch.from_arrays([
        pa.array(bodies, type=pa.binary()),
        pa.array(keys, type=pa.string()),
        pa.array(tags, type=pa.string()),
        pa.array(props, type=pa.map_(pa.string(), pa.string())),
        pa.array(uks, type=pa.string()),
        pa.array([topic] * len(bodies), type=pa.string()),
        pa.array(queues, type=pa.int32()),
        pa.array(offsets, type=pa.int64()),
        _micros(born),
        _micros(stored),
        pa.array(recons, type=pa.int32()),
    ], schema=ARROW_SCHEMA)
