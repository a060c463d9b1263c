"""The ``onceq`` PySpark data source: batch and streaming readers.

Planning (which offsets a read or a micro-batch covers) runs on the driver through the
blocking client; each input partition is a ``QueueRange`` that carries everything an
executor needs, and ``read()`` opens its own connection there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from ..client.admin import Admin
from ..client.connection import ConnectionLost, retriable
from ..client.security import ClientSecurity
from ..client.sync import SyncPullConsumer
from ..protocol.errors import ErrorCode, OnceqError
from .arrow import ARROW_SCHEMA, SCHEMA_DDL
from .decode import BodyDecoder
from .options import (
    OptionError,
    SourceOptions,
    TopicQueue,
    admit,
    check_loss,
    from_offsets,
    resolve,
    split_range,
    to_offsets,
)
from .pulling import QueueRange, read_range
from .retry import Backoff
from .sink import SinkMixin

log = logging.getLogger("onceq.spark")
T = TypeVar("T")


class RangePartition(InputPartition):
    """An input partition: one queue range (and how to decode bodies, if asked)."""

    def __init__(self, r: QueueRange, decoder: BodyDecoder | None = None) -> None:
        super().__init__(r)
        self.range = r
        self.decoder = decoder


def _read(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    if isinstance(partition, RangePartition):  # Spark reads a placeholder when none
        decoder = partition.decoder
        for batch in read_range(partition.range):
            yield batch if decoder is None else decoder.apply(batch)


def _decoder(opts: SourceOptions, schema: StructType) -> BodyDecoder | None:
    """The decoded columns are those of ``schema`` after the source's own."""
    if opts.body_format != "json":
        return None
    from pyspark.sql.pandas.types import to_arrow_schema

    base = len(ARROW_SCHEMA) - (0 if opts.include_body else 1)
    extra = StructType(schema.fields[base:])
    clash = sorted(set(extra.fieldNames()) & set(ARROW_SCHEMA.names))
    if clash:
        raise OptionError(f"option 'bodySchema' names columns the source has already: {clash}")
    return BodyDecoder(list(to_arrow_schema(extra, timezone="UTC")), opts.include_body)


class OnceqDataSource(SinkMixin, DataSource):
    """``spark.read.format("onceq")`` and ``spark.readStream.format("onceq")``; the writers
    (``df.write``, ``df.writeStream``) are in ``sink.py``."""

    @classmethod
    def name(cls) -> str:
        return "onceq"

    def schema(self) -> str:
        opts = {k.lower(): v for k, v in self.options.items()}
        ddl = SCHEMA_DDL
        if opts.get("includebody", "true").strip().lower() in ("false", "0", "no"):
            ddl = ddl.removeprefix("body BINARY, ")
        body_schema = opts.get("bodyschema", "").strip()
        return f"{ddl}, {body_schema}" if body_schema else ddl

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = SourceOptions.parse(self.options, streaming=False)
        return OnceqBatchReader(opts, _decoder(opts, schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        opts = SourceOptions.parse(self.options, streaming=True)
        return OnceqStreamReader(opts, _decoder(opts, schema))


class _Planner:
    """The driver's view of the topic: queues and their offsets (one connection, opened
    when first needed and never pickled). Every call to the broker rides out a restart:
    it is tried again until the broker has failed every attempt for ``readTimeout``."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._client: SyncPullConsumer | None = None
        self.backoff = Backoff(opts.read_timeout_s, f"planning {opts.label} at {opts.servers}")

    @property
    def client(self) -> SyncPullConsumer:
        if self._client is None:
            self._client = SyncPullConsumer(self.opts.servers, self.opts.group,
                                            security=self.opts.security)
        return self._client

    def call(self, fn: Callable[[SyncPullConsumer], T]) -> T:
        """``fn(client)``, tried again after a retriable error or a lost connection (on a
        new connection) until ``readTimeout`` runs out."""
        return self.retrying(lambda: fn(self.client))

    def retrying(self, fn: Callable[[], T]) -> T:
        while True:
            try:
                value = fn()
            except OnceqError as exc:
                if not retriable(exc):
                    raise
                if isinstance(exc, ConnectionLost):
                    self.close()
                time.sleep(self.backoff.failed(exc))
                continue
            self.backoff.ok()
            return value

    def queues(self) -> list[TopicQueue]:
        """The queues read, topic by topic (a pattern is matched again at every call:
        a topic created since is read from its earliest offset)."""
        o = self.opts
        if o.topic_pattern is None:
            counts = {t: self.call(lambda c, t=t: c.queue_count(t)) for t in o.topics}
        else:
            topics = self.retrying(lambda: asyncio.run(_list_topics(o.servers, o.security)))
            counts = {t["topic"]: int(t["queues"]) for t in topics
                      if not t["topic"].startswith("%")  # retry and dead-letter topics
                      and o.subscribes(t["topic"])}
        if o.queues is None:
            return [(t, q) for t in sorted(counts) for q in range(counts[t])]
        (topic, count), = counts.items()
        missing = [q for q in o.queues if q >= count]
        if missing:
            raise ValueError(f"onceq: topic {topic!r} has {count} queues; option "
                             f"'queues' names {missing}")
        return [(topic, q) for q in o.queues]

    def bounds(self, queues: Sequence[TopicQueue]) -> dict[TopicQueue, tuple[int, int]]:
        return {(t, q): self.call(lambda c, t=t, q=q: c.queue_offsets(t, q)) for t, q in queues}

    def starting(self, queues: Sequence[TopicQueue],
                 bounds: dict[TopicQueue, tuple[int, int]]) -> dict[TopicQueue, int]:
        ts = self.opts.starting_timestamp
        if ts is not None:
            return {(t, q): self.call(lambda c, t=t, q=q: c.search_offset(t, q, ts))
                    for t, q in queues}
        return {tq: resolve(self.opts.starting, tq, bounds[tq]) for tq in queues}

    def range(self, tq: TopicQueue, start: int, end: int) -> list[QueueRange]:
        o = self.opts
        return [QueueRange(o.servers, o.group, tq[0], tq[1], s, e, o.fail_on_data_loss,
                           o.pull_batch, o.verify_checksums, o.read_timeout_s, o.security)
                for s, e in split_range(start, end, o.max_messages_per_partition)]

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                client.close()
            except OnceqError as exc:  # a connection already broken: nothing to tell it
                log.debug("onceq: closing the planning connection: %s", exc)

    def __getstate__(self) -> dict[str, Any]:  # a connection does not travel
        return {"opts": self.opts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _Planner.__init__(self, state["opts"])


async def _list_topics(servers: str, security: ClientSecurity | None
                       ) -> list[dict[str, Any]]:
    async with Admin(servers, security=security) as admin:
        return await admin.list_topics()


class OnceqBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions, decoder: BodyDecoder | None = None) -> None:
        self.opts = opts
        self.decoder = decoder
        self.planner = _Planner(opts)

    def partitions(self) -> Sequence[InputPartition]:
        p = self.planner
        try:
            queues = p.queues()
            bounds = p.bounds(queues)
            start = p.starting(queues, bounds)
            parts: list[InputPartition] = []
            for tq in queues:
                lo, hi = bounds[tq]
                begin = check_loss(tq[0], tq[1], start[tq], lo, self.opts.fail_on_data_loss)
                end = min(resolve(self.opts.ending, tq, bounds[tq]), hi)
                parts += [RangePartition(r, self.decoder) for r in p.range(tq, begin, end)]
        finally:
            p.close()
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read(partition)


class OnceqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Queues are partitions; offsets are ``{"topic": {"queue": offset}}``. The end offsets of
    finished batches are committed to the broker under the ``group`` option, so the group's
    lag shows the query's; the checkpoint stays the source of truth."""

    def __init__(self, opts: SourceOptions, decoder: BodyDecoder | None = None) -> None:
        self.opts = opts
        self.decoder = decoder
        self.planner = _Planner(opts)
        self._target: dict[TopicQueue, int] | None = None  # AvailableNow: read up to here
        self._reported: dict[TopicQueue, int] = {}  # offsets committed to the broker

    # ------------------------------------------------------------------ planning
    def initialOffset(self) -> dict:
        queues = self.planner.queues()
        return to_offsets(self.planner.starting(queues, self.planner.bounds(queues)))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_messages_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def prepareForTriggerAvailableNow(self) -> None:
        queues = self.planner.queues()
        self._target = {tq: hi for tq, (_lo, hi) in self.planner.bounds(queues).items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = from_offsets(self.opts, start)
        # every batch up to ``start`` has finished (Spark plans the next batch only then)
        self._report(begin)
        queues = self.planner.queues()
        bounds = self.planner.bounds(queues)
        latest = {tq: hi for tq, (_lo, hi) in bounds.items()}
        if self._target is not None:
            latest = {tq: min(hi, self._target.get(tq, begin.get(tq, 0))) for tq, hi in
                      latest.items()}
        effective = {}
        for tq in queues:
            lo = bounds[tq][0]
            s = begin.get(tq, lo)  # a queue added since: from its earliest offset
            effective[tq] = check_loss(tq[0], tq[1], s, lo, self.opts.fail_on_data_loss)
            if effective[tq] != s:
                log.warning("onceq: %s/%d: %d messages were deleted before they were read; "
                            "skipping to offset %d (failOnDataLoss=false)", tq[0], tq[1],
                            effective[tq] - s, effective[tq])
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return to_offsets(admit(effective, latest, max_rows))

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        begin, stop = from_offsets(self.opts, start), from_offsets(self.opts, end)
        # a queue (or topic) added since ``start`` begins at its earliest offset
        added = self.planner.bounds([tq for tq in stop if tq not in begin])
        begin.update({tq: lo for tq, (lo, _hi) in added.items()})
        parts: list[InputPartition] = []
        for tq in sorted(stop):
            parts += [RangePartition(r, self.decoder)
                      for r in self.planner.range(tq, begin[tq], stop[tq])]
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read(partition)

    # ------------------------------------------------------------------ progress
    def commit(self, end: dict) -> None:
        self._report(from_offsets(self.opts, end))

    def _report(self, offsets: dict[TopicQueue, int]) -> None:
        """Commit finished offsets to the broker (lag reporting: a broker that fails is
        retried within ``readTimeout``, then the failure is logged and the offsets are
        reported with the next batch)."""
        for (t, q), off in sorted(offsets.items()):
            if self._reported.get((t, q), -1) >= off:
                continue
            try:
                self.planner.call(lambda c, t=t, q=q, off=off: c.commit_offset(t, q, off))
            except OnceqError as exc:
                if exc.code != ErrorCode.OFFSET_BEHIND:
                    log.warning("onceq: could not commit %s/%d=%d for group %s: %s",
                                t, q, off, self.opts.group, exc)
                    return
                # the group's offset is further on (a query replaying from an older
                # checkpoint): only a reset moves it back, and there is nothing to report
            except Exception as exc:  # the checkpoint is the truth: report, go on
                log.warning("onceq: could not commit %s/%d=%d for group %s: %s",
                            t, q, off, self.opts.group, exc)
                return
            self._reported[t, q] = off

    def stop(self) -> None:
        self.planner.close()
