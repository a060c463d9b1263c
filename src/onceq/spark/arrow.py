"""The rows the source yields: the Spark schema and messages as Arrow record batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from ..client.message import MessageExt

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
