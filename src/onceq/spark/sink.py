"""The ``onceq`` sink: ``df.write.format("onceq")`` and ``df.writeStream.format("onceq")``.

Exactly once across task retries and batch replays: every task is an idempotent writer
(``client/sequenced.py``) whose id, epoch and sequence numbers are functions of the data
only, so a retried task or a replayed batch sends the same numbers and the broker drops
what it already stored, however long after (until the writer's idle expiry, 7 days by
default):

- writer id: ``<query id or option writerId>/<partition>`` (streaming), ``<job id or option
  writerId>/<partition>`` (batch; the job id is drawn once on the driver);
- epoch: the micro-batch id (streaming), 0 (batch);
- sequence: the row's rank among the rows of that task sent to the same queue;
- unique key: derived from the writer, epoch, queue and sequence.

A row's queue: its ``queue`` column, else the hash of its ``sharding_key`` (as the producer
picks it), else ``(partition + row index // batchSize) % queues``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

from ..client.security import ClientSecurity
from ..client.sequenced import SequencedWriter
from .encode import encode_chunk, route, split_by_queue
from .options import OptionError, _int_option, security_options

log = logging.getLogger("onceq.spark")

COLUMNS = {
    "body": (BinaryType, StringType),
    "keys": (StringType, ArrayType),
    "tags": (StringType,),
    "properties": (MapType,),
    "queue": (IntegerType, LongType, ShortType),
    "sharding_key": (StringType,),
}
QUERY_ID = "sql.streaming.queryId"  # local properties Spark sets on a streaming query's tasks
BATCH_ID = "streaming.sql.batchId"


@dataclass(frozen=True, slots=True)
class SinkOptions:
    servers: str
    topic: str
    writer_id: str | None
    batch_size: int
    in_flight: int
    timeout_s: int
    security: ClientSecurity | None = None  # None: from the environment (ONCEQ_USER...)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        opts = {k.lower(): v for k, v in options.items()}
        topic = opts.get("topic", "").strip()
        if not topic:
            raise OptionError("option 'topic' is required")
        writer_id = opts.get("writerid", "").strip() or None
        if writer_id is not None and (len(writer_id) > 150 or not writer_id.isprintable()):
            raise OptionError("option 'writerId' must be 1-150 printable characters")
        return cls(
            servers=opts.get("servers", "127.0.0.1:9876"),
            topic=topic,
            writer_id=writer_id,
            batch_size=_int_option(opts, "batchsize", 1000, "batchSize", minimum=1) or 1000,
            in_flight=_int_option(opts, "maxinflight", 4, "maxInFlight", minimum=1) or 4,
            timeout_s=_int_option(opts, "sendtimeout", 60, "sendTimeout", minimum=1) or 60,
            security=security_options(opts),
        )


def check_schema(schema: StructType) -> None:
    """The columns the sink takes (body required); anything else is an error."""
    names = [f.name for f in schema.fields]
    if "body" not in names:
        raise OptionError(f"the onceq sink needs a 'body' column (binary or string); the "
                          f"data has {names}")
    for f in schema.fields:
        allowed = COLUMNS.get(f.name)
        if allowed is None:
            raise OptionError(f"the onceq sink does not take column {f.name!r}: its columns "
                              f"are {sorted(COLUMNS)} (select or rename them)")
        if not isinstance(f.dataType, allowed):
            raise OptionError(f"column {f.name!r} has type {f.dataType.simpleString()}, not "
                              f"one of {[t.__name__ for t in allowed]}")
        if f.name == "keys" and isinstance(f.dataType, ArrayType) and not isinstance(
                f.dataType.elementType, StringType):
            raise OptionError("column 'keys' must be a string or an array of strings")
        if f.name == "properties" and not (isinstance(f.dataType.keyType, StringType)
                                           and isinstance(f.dataType.valueType, StringType)):
            raise OptionError("column 'properties' must be a map<string, string>")


@dataclass(slots=True)
class SinkCommit(WriterCommitMessage):
    """What one task wrote: the messages stored and those the broker already had."""

    writer: str
    epoch: int
    rows: int
    stored: int
    duplicates: int


def key_prefix(writer: str, epoch: int, queue: int) -> str:
    """Unique keys are this prefix and the sequence number."""
    return f"{hashlib.sha1(writer.encode()).hexdigest()[:16]}-{epoch}-{queue}-"


async def write_partition(opts: SinkOptions, writer: str, epoch: int, partition: int,
                          batches: Iterator[pa.RecordBatch]) -> SinkCommit:
    """Send the rows of one task; returns once all are stored."""
    sender = SequencedWriter(opts.servers, writer, epoch, window=opts.in_flight,
                             timeout=opts.timeout_s, security=opts.security)
    size = opts.batch_size
    pending: dict[int, list[pa.RecordBatch]] = {}
    counts: dict[int, int] = {}
    seqs: dict[int, int] = {}
    rows = 0
    try:
        queues = await sender.queue_count(opts.topic)

        async def send(q: int, chunk: pa.RecordBatch) -> None:
            seq = seqs.get(q, 0)
            seqs[q] = seq + chunk.num_rows
            payload = encode_chunk(chunk, writer, epoch, seq, key_prefix(writer, epoch, q))
            await sender.submit_payload(opts.topic, q, seq, chunk.num_rows, payload)

        for batch in batches:
            if not batch.num_rows:
                continue
            targets = route(batch, queues, partition, rows, size)
            rows += batch.num_rows
            for q, part in split_by_queue(batch, targets):
                pending.setdefault(q, []).append(part)
                counts[q] = counts.get(q, 0) + part.num_rows
                if counts[q] < size:
                    continue
                table = pa.Table.from_batches(pending.pop(q))
                while table.num_rows >= size:
                    await send(q, table.slice(0, size).combine_chunks().to_batches()[0])
                    table = table.slice(size)
                counts[q] = table.num_rows
                if table.num_rows:
                    pending[q] = table.combine_chunks().to_batches()
        for q in sorted(pending):
            rest = pa.Table.from_batches(pending[q]).combine_chunks().to_batches()
            if rest and rest[0].num_rows:
                await send(q, rest[0])
        await sender.flush()
    finally:
        await sender.close()
    return SinkCommit(writer, epoch, rows, sender.stored, sender.duplicates)


def run_partition(opts: SinkOptions, base: str, epoch: int,
                  batches: Iterator[pa.RecordBatch]) -> SinkCommit:
    partition = TaskContext.get().partitionId()
    writer = f"{base}/{partition}"
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(write_partition(opts, writer, epoch, partition, batches))
    finally:
        loop.close()


def _totals(messages: list[Any]) -> tuple[int, int, int]:
    done = [m for m in messages if isinstance(m, SinkCommit)]
    return (sum(m.rows for m in done), sum(m.stored for m in done),
            sum(m.duplicates for m in done))


class OnceqBatchWriter(DataSourceArrowWriter):
    """``df.write.format("onceq")``: one job id for the whole write, drawn on the driver."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts
        self.base = opts.writer_id or f"job-{uuid.uuid4()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:
        return run_partition(self.opts, self.base, 0, iterator)

    def commit(self, messages: list[Any]) -> None:
        rows, stored, dups = _totals(messages)
        log.info("onceq sink: %s wrote %d rows to %s (%d stored, %d already stored)",
                 self.base, rows, self.opts.topic, stored, dups)

    def abort(self, messages: list[Any]) -> None:
        log.warning("onceq sink: write %s to %s aborted; messages of finished tasks stay "
                    "stored (writing again with option writerId=%s stores only the rest)",
                    self.base, self.opts.topic, self.base)


class OnceqStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("onceq")``: the epoch is the micro-batch id."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommit:
        ctx = TaskContext.get()
        batch_id = ctx.getLocalProperty(BATCH_ID)
        base = self.opts.writer_id or ctx.getLocalProperty(QUERY_ID)
        if batch_id is None or base is None:
            raise RuntimeError("onceq sink: the task carries no streaming query or batch id")
        return run_partition(self.opts, base, int(batch_id), iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        rows, stored, dups = _totals(messages)
        log.info("onceq sink: batch %d wrote %d rows to %s (%d stored, %d already stored)",
                 batchId, rows, self.opts.topic, stored, dups)

    def abort(self, messages: list[Any], batchId: int) -> None:
        log.warning("onceq sink: batch %d to %s aborted; messages of finished tasks stay "
                    "stored, and the replay of the batch stores only the rest", batchId,
                    self.opts.topic)


class SinkMixin:
    """The writer side of the ``onceq`` data source."""

    options: dict[str, str]

    def writer(self, schema: StructType, overwrite: bool) -> OnceqBatchWriter:
        check_schema(schema)
        return OnceqBatchWriter(SinkOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool
                     ) -> OnceqStreamWriter:
        check_schema(schema)
        return OnceqStreamWriter(SinkOptions.parse(self.options))
