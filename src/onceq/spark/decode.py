"""``bodyFormat=json``: message bodies decoded into columns on the executor, by Arrow's
JSON reader (one pass over a pull's bodies), beside or instead of ``body``."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.json as pj

from .options import OptionError

_EMPTY = b"{}"  # a body that is not a JSON object: a row of nulls


class BodyDecoder:
    """Picklable: travels in the input partition. ``fields`` are the decoded columns
    (Arrow types Spark expects); ``keep_body`` keeps the ``body`` column."""

    def __init__(self, fields: Sequence[pa.Field], keep_body: bool) -> None:
        self.schema = pa.schema(list(fields))
        self.keep_body = keep_body
        maps = [f.name for f in fields if pa.types.is_map(f.type)]
        if maps:
            raise OptionError(f"option 'bodySchema': MAP columns cannot be decoded from "
                              f"JSON ({maps}); use a STRUCT")
        # Arrow's JSON reader parses ISO-8601 timestamps, not dates: read a date as a
        # timestamp, then cast
        self._read_schema = pa.schema([
            f.with_type(pa.timestamp("s")) if pa.types.is_date32(f.type) else f
            for f in fields])

    def __reduce__(self) -> tuple[object, ...]:
        return (BodyDecoder, (list(self.schema), self.keep_body))

    def decode(self, bodies: Sequence[bytes | None]) -> pa.Table:
        """One row per body; a body that is not a JSON object, or whose values do not fit
        the schema, gives a row of nulls (as Spark's ``from_json`` does)."""
        lines = [_one_line(b) for b in bodies]
        if not lines:
            return self.schema.empty_table()
        table = None
        with contextlib.suppress(pa.ArrowInvalid):
            table = self._read(b"\n".join(lines))
        if table is None or table.num_rows != len(lines):
            # a value of the wrong type somewhere: row by row, that row's fields null
            parts = []
            for line in lines:
                try:
                    parts.append(self._read(line))
                except pa.ArrowInvalid:
                    parts.append(self._read(_EMPTY))
            table = pa.concat_tables(parts)
        return table if self._read_schema == self.schema else table.cast(self.schema,
                                                                           safe=False)

    def _read(self, data: bytes) -> pa.Table:
        opts = pj.ParseOptions(explicit_schema=self._read_schema,
                               unexpected_field_behavior="ignore")
        return pj.read_json(io.BytesIO(data), parse_options=opts,
                            read_options=pj.ReadOptions(block_size=max(1 << 20, len(data) + 1)))

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The source's batch with the decoded columns appended (``body`` dropped unless
        ``keep_body``)."""
        decoded = self.decode(batch.column("body").to_pylist()).combine_chunks()
        names = [n for n in batch.schema.names if self.keep_body or n != "body"]
        arrays = [batch.column(n) for n in names]
        arrays += [decoded.column(f.name).chunk(0) if decoded.column(f.name).num_chunks
                   else pa.array([], f.type) for f in self.schema]
        return pa.RecordBatch.from_arrays(arrays, names=names + self.schema.names)


def _one_line(body: bytes | None) -> bytes:
    """The body as one line of NDJSON: as is when it looks like one compact object, else
    re-serialised (pretty-printed JSON), else ``{}``."""
    if not body:
        return _EMPTY
    stripped = body.strip()
    if stripped[:1] == b"{" and b"\n" not in stripped and b"\r" not in stripped:
        return stripped
    try:
        value = json.loads(body)
    except ValueError:
        return _EMPTY
    return json.dumps(value, separators=(",", ":")).encode() if isinstance(value, dict) \
        else _EMPTY
