"""The ``onceq`` PySpark data source: batch and streaming readers.

Planning (which offsets a read or a micro-batch covers) runs on the driver through the
blocking client; each input partition is a ``QueueRange`` that carries everything an
executor needs, and ``read()`` opens its own connection there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

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

from ..client.sync import SyncPullConsumer
from .arrow import SCHEMA_DDL
from .options import (
    SourceOptions,
    admit,
    check_loss,
    from_offsets,
    resolve,
    split_range,
    to_offsets,
)
from .pulling import QueueRange, read_range

log = logging.getLogger("onceq.spark")


class RangePartition(InputPartition):
    """An input partition: one queue range."""

    def __init__(self, r: QueueRange) -> None:
        super().__init__(r)
        self.range = r


class OnceqDataSource(DataSource):
    """``spark.read.format("onceq")`` and ``spark.readStream.format("onceq")``."""

    @classmethod
    def name(cls) -> str:
        return "onceq"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return OnceqBatchReader(SourceOptions.parse(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return OnceqStreamReader(SourceOptions.parse(self.options, streaming=True))


class _Planner:
    """The driver's view of the topic: queues and their offsets (one connection, opened
    when first needed and never pickled)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._client: SyncPullConsumer | None = None

    @property
    def client(self) -> SyncPullConsumer:
        if self._client is None:
            self._client = SyncPullConsumer(self.opts.servers, self.opts.group)
        return self._client

    def queues(self) -> list[int]:
        count = self.client.queue_count(self.opts.topic)
        if self.opts.queues is None:
            return list(range(count))
        missing = [q for q in self.opts.queues if q >= count]
        if missing:
            raise ValueError(f"onceq: topic {self.opts.topic!r} has {count} queues; option "
                             f"'queues' names {missing}")
        return list(self.opts.queues)

    def bounds(self, queues: Sequence[int]) -> dict[int, tuple[int, int]]:
        return {q: self.client.queue_offsets(self.opts.topic, q) for q in queues}

    def starting(self, queues: Sequence[int], bounds: dict[int, tuple[int, int]]
                 ) -> dict[int, int]:
        if self.opts.starting_timestamp is not None:
            return {q: self.client.search_offset(self.opts.topic, q,
                                                 self.opts.starting_timestamp)
                    for q in queues}
        return {q: resolve(self.opts.starting, q, bounds[q]) for q in queues}

    def range(self, queue: int, start: int, end: int) -> list[QueueRange]:
        o = self.opts
        return [QueueRange(o.servers, o.group, o.topic, queue, s, e, o.fail_on_data_loss,
                           o.pull_batch, o.verify_checksums)
                for s, e in split_range(start, end, o.max_messages_per_partition)]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:  # a connection does not travel
        return {"opts": self.opts, "_client": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class OnceqBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.planner = _Planner(opts)

    def partitions(self) -> Sequence[InputPartition]:
        p = self.planner
        try:
            queues = p.queues()
            bounds = p.bounds(queues)
            start = p.starting(queues, bounds)
            parts: list[InputPartition] = []
            for q in queues:
                lo, hi = bounds[q]
                begin = check_loss(self.opts.topic, q, start[q], lo, self.opts.fail_on_data_loss)
                end = min(resolve(self.opts.ending, q, bounds[q]), hi)
                parts += [RangePartition(r) for r in p.range(q, begin, end)]
        finally:
            p.close()
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, RangePartition):  # Spark reads a placeholder when none
            yield from read_range(partition.range)


class OnceqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Queues are partitions; offsets are ``{"topic/queue": offset}``. The end offsets of
    finished batches are committed to the broker under the ``group`` option, so the group's
    lag shows the query's; the checkpoint stays the source of truth."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.planner = _Planner(opts)
        self._target: dict[int, int] | None = None  # Trigger.AvailableNow: read up to here
        self._reported: dict[int, int] = {}  # offsets committed to the broker

    # ------------------------------------------------------------------ planning
    def initialOffset(self) -> dict:
        queues = self.planner.queues()
        return to_offsets(self.opts.topic,
                          self.planner.starting(queues, self.planner.bounds(queues)))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_messages_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def prepareForTriggerAvailableNow(self) -> None:
        queues = self.planner.queues()
        self._target = {q: hi for q, (_lo, hi) in self.planner.bounds(queues).items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        topic = self.opts.topic
        begin = from_offsets(topic, start)
        # every batch up to ``start`` has finished (Spark plans the next batch only then)
        self._report(begin)
        queues = self.planner.queues()
        bounds = self.planner.bounds(queues)
        latest = {q: hi for q, (_lo, hi) in bounds.items()}
        if self._target is not None:
            latest = {q: min(hi, self._target.get(q, begin.get(q, 0))) for q, hi in
                      latest.items()}
        effective = {}
        for q in queues:
            lo = bounds[q][0]
            s = begin.get(q, lo)  # a queue added since: from its earliest offset
            effective[q] = check_loss(topic, q, s, lo, self.opts.fail_on_data_loss)
            if effective[q] != s:
                log.warning("onceq: %s/%d: %d messages were deleted before they were read; "
                            "skipping to offset %d (failOnDataLoss=false)", topic, q,
                            effective[q] - s, effective[q])
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = admit(effective, latest, max_rows)
        return to_offsets(topic, end)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        topic = self.opts.topic
        begin, stop = from_offsets(topic, start), from_offsets(topic, end)
        # a queue added to the topic since ``start`` begins at its earliest offset
        added = self.planner.bounds([q for q in stop if q not in begin])
        begin.update({q: lo for q, (lo, _hi) in added.items()})
        parts: list[InputPartition] = []
        for q in sorted(stop):
            parts += [RangePartition(r) for r in self.planner.range(q, begin[q], stop[q])]
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, RangePartition):  # Spark reads a placeholder when none
            yield from read_range(partition.range)

    # ------------------------------------------------------------------ progress
    def commit(self, end: dict) -> None:
        self._report(from_offsets(self.opts.topic, end))

    def _report(self, offsets: dict[int, int]) -> None:
        """Commit finished offsets to the broker (lag reporting; failures only logged)."""
        for q, off in sorted(offsets.items()):
            if self._reported.get(q, -1) >= off:
                continue
            try:
                self.planner.client.commit_offset(self.opts.topic, q, off)
            except Exception as exc:  # the checkpoint is the truth: report, go on
                log.warning("onceq: could not commit %s/%d=%d for group %s: %s",
                            self.opts.topic, q, off, self.opts.group, exc)
                return
            self._reported[q] = off

    def stop(self) -> None:
        self.planner.close()
