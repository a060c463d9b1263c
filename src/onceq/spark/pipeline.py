"""The exactly-once pipeline: order events from an onceq topic into inventory totals.

    onceq topic -> JSON body decoded (``from_json``) -> watermark on the event time
    -> ``dropDuplicatesWithinWatermark(order_id)`` -> ``foreachBatch``: one database
    transaction per micro-batch that records (query id, batch id), the orders it counts
    and the per-product totals together (``inventory``).

What makes each order count once:

* the source is replayable: Spark writes a batch's offsets to the checkpoint before it runs
  and, after a failure or a restart, runs exactly that range again with the same batch id;
* a replayed batch finds its (query id, batch id) row and changes nothing;
* duplicates within the watermark delay are dropped by Spark (state kept in the
  checkpoint); a duplicate arriving later is caught by the orders table, which holds every
  order id counted (``keep_order_ids``, default on). Without it, totals are summed by Spark
  per product and such a late duplicate would be counted twice.

Not covered: an order whose event time is older than the watermark when it arrives is
dropped by Spark as late (counted as ``late_rows`` in the result); choose a watermark delay
above the longest lateness your producers show.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..client.connection import ConnectionLost
from ..protocol.errors import ErrorCode, OnceqError
from .inventory import MAX_ID_CHARS, BatchOutcome, InventoryStore, ProductTotal
from .orders import ORDER_SCHEMA

__all__ = ["BatchReport", "CheckpointMismatch", "PipelineConfig", "PipelineError",
           "PipelineResult", "check_broker", "local_spark", "run_pipeline"]

log = logging.getLogger("onceq.spark.pipeline")

AVAILABLE_NOW = "available-now"


@dataclass(frozen=True)
class PipelineConfig:
    """Where the pipeline reads, keeps its progress and writes.

    ``trigger`` is ``"available-now"`` (read what is there, in as many micro-batches as
    ``max_messages_per_trigger`` needs, and stop) or a processing interval such as
    ``"5 seconds"`` (run until ``timeout_s`` or until ``stop`` is set).

    ``checkpoint`` None: ``onceq-pipeline-checkpoint-<hash>`` in the current directory, the
    hash of the database (``sink_identity``), the table prefix and the topic, so that
    another database or topic starts from a checkpoint of its own."""

    servers: str = "127.0.0.1:9876"
    topic: str = "orders"
    group: str | None = None  # consumer group of the reported progress: pipeline-<topic>
    checkpoint: str | None = None  # None: derived (``checkpoint_location``)
    database: str = "sqlite:///onceq-pipeline.db"
    trigger: str = AVAILABLE_NOW
    watermark: str = "10 minutes"
    starting_offsets: str = "earliest"
    max_messages_per_trigger: int | None = None
    keep_order_ids: bool = True
    table_prefix: str = "onceq_pipeline"
    timeout_s: float | None = None
    shuffle_partitions: int | None = None  # set on the session if given
    read_timeout_s: int | None = None  # the source's readTimeout (None: its default)

    @property
    def group_name(self) -> str:
        return self.group or f"pipeline-{self.topic}"

    @property
    def checkpoint_location(self) -> str:
        """``checkpoint``, or the default for this database, table prefix and topic."""
        if self.checkpoint is not None:
            return self.checkpoint
        ident = json.dumps([sink_identity(self.database, self.table_prefix), self.topic],
                           sort_keys=True)
        digest = hashlib.sha1(ident.encode()).hexdigest()[:10]
        return os.path.abspath(f"onceq-pipeline-checkpoint-{digest}")


class PipelineError(RuntimeError):
    """The pipeline's query failed. ``broker_error``: the onceq error behind it, when the
    failure came from the broker (a ``ConnectionLost`` when it was out of reach)."""

    def __init__(self, message: str, broker_error: OnceqError | None = None) -> None:
        super().__init__(message)
        self.broker_error = broker_error


class CheckpointMismatch(ValueError):
    """The checkpoint holds the progress of a pipeline that wrote to another database or
    table set: continuing from it would give this one nothing of what was read before."""


_SCHEMES = {"postgres": "postgresql", "mariadb": "mysql", "mysql+pymysql": "mysql"}


def sink_identity(database: str, table_prefix: str) -> dict[str, str]:
    """What names the pipeline's tables: the database URL without its password (a SQLite
    file by its absolute path) and the table prefix."""
    parts = urlsplit(database)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        path = database.split("://", 1)[1].split("?", 1)[0]
        path = path[1:] if path.startswith("/") else path
        url = f"sqlite:///{os.path.abspath(path)}"
    else:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username}@{host}" if parts.username else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        url = f"{_SCHEMES.get(scheme, scheme)}://{netloc}{parts.path}"
        if parts.query:
            url += f"?{parts.query}"
    return {"database": url, "table_prefix": table_prefix}


@dataclass(frozen=True)
class BatchReport:
    """One micro-batch, as Spark and the database saw it."""

    batch_id: int
    rows_in: int  # messages read
    malformed: int  # bodies that are not an order (skipped)
    late_rows: int  # dropped by Spark: event time older than the watermark
    spark_duplicates: int  # dropped by dropDuplicatesWithinWatermark
    late_duplicates: int  # orders counted before (orders table)
    orders_new: int  # orders counted by this batch
    products: int  # inventory rows upserted
    replayed: bool  # applied before: the database was left as it was
    duration_s: float
    # False for a batch stopped after its database commit but before Spark recorded its
    # progress: rows_in is then the rows written (Spark's counts are unknown) and the next
    # run reports the same batch again in full, as a replay
    from_progress: bool = True

    def line(self) -> str:
        state = "replayed: nothing changed" if self.replayed else (
            f"{self.orders_new} new orders -> {self.products} products upserted")
        return (f"batch {self.batch_id}: {self.rows_in} rows in, {self.spark_duplicates} "
                f"duplicates dropped in Spark, {self.late_duplicates} late duplicates, "
                f"{self.late_rows} late rows, {self.malformed} malformed; {state} "
                f"({self.duration_s:.2f}s)")


@dataclass
class PipelineResult:
    query_id: str
    batches: list[BatchReport] = field(default_factory=list)
    totals: dict[str, ProductTotal] = field(default_factory=dict)  # read after the run

    @property
    def rows_in(self) -> int:
        return sum(b.rows_in for b in self.batches)

    @property
    def duplicates_dropped(self) -> int:
        return sum(b.spark_duplicates + b.late_duplicates for b in self.batches)

    @property
    def orders_counted(self) -> int:
        return sum(b.orders_new for b in self.batches)

    @property
    def rows_upserted(self) -> int:
        return sum(b.products for b in self.batches)

    @property
    def replayed_batches(self) -> int:
        return sum(b.replayed for b in self.batches)


class _BatchWriter:
    """``foreachBatch``'s function (runs on the driver): one transaction per batch."""

    def __init__(self, config: PipelineConfig, store: InventoryStore) -> None:
        self.config = config
        self.store = store
        self.outcomes: dict[int, tuple[BatchOutcome, int, float]] = {}
        self.query_id: str | None = None
        self._lock = threading.Lock()

    def __call__(self, batch: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        t0 = time.perf_counter()
        query_id = self._query_id(batch)
        if self.config.keep_order_ids:
            t = batch.select("order_id", "product", "quantity").toArrow()  # columnar
            orders = list(zip(*(t.column(i).to_pylist() for i in range(3)), strict=True))
            outcome = self.store.apply_batch(query_id, batch_id, orders=orders)
            n = len(orders)
        else:
            rows = (batch.groupBy("product")
                    .agg(F.sum("quantity").alias("q"), F.count(F.lit(1)).alias("n")).collect())
            outcome = self.store.apply_batch(query_id, batch_id,
                                             totals=[(r[0], r[1], r[2]) for r in rows])
            n = sum(r[2] for r in rows)
        with self._lock:
            self.outcomes[batch_id] = (outcome, n, time.perf_counter() - t0)

    def _query_id(self, batch: Any) -> str:
        """Spark's query id: the same for every run from one checkpoint."""
        if self.query_id is None:
            qid = batch.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
            if not qid:
                raise RuntimeError("foreachBatch ran without a streaming query id")
            self.query_id = qid
        return self.query_id


def local_spark(master: str = "local[2]", app: str = "onceq-pipeline",
                shuffle_partitions: int = 4) -> Any:
    """A SparkSession for this machine: executors run this interpreter (it has onceq),
    no UI or console progress bars, few shuffle partitions (the dedup state's), quiet logs,
    the ``onceq`` source registered."""
    from pyspark.sql import SparkSession

    import onceq.spark

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(shuffle_partitions)).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    onceq.spark.register(spark)
    return spark


def _plan(spark: Any, config: PipelineConfig, writer: _BatchWriter) -> Any:
    from pyspark.sql import functions as F

    reader = (spark.readStream.format("onceq").option("servers", config.servers)
              .option("topic", config.topic).option("group", config.group_name)
              .option("startingOffsets", config.starting_offsets))
    if config.read_timeout_s is not None:
        reader = reader.option("readTimeout", str(config.read_timeout_s))
    if config.max_messages_per_trigger is not None:
        reader = reader.option("maxMessagesPerTrigger", str(config.max_messages_per_trigger))
    order = F.from_json(F.col("body").cast("string"), ORDER_SCHEMA)
    decoded = reader.load().select(order.alias("o")).select("o.*")
    valid = (F.length("order_id").between(1, MAX_ID_CHARS)
             & F.length("product").between(1, MAX_ID_CHARS)
             & F.col("quantity").isNotNull() & F.col("event_time").isNotNull())
    observed = decoded.observe(
        "onceq_pipeline_input", F.count(F.lit(1)).alias("rows"),
        F.sum(F.when(valid, 0).otherwise(1)).alias("malformed"))
    deduped = (observed.where(valid).withWatermark("event_time", config.watermark)
               .dropDuplicatesWithinWatermark(["order_id"]))
    stream = (deduped.writeStream.foreachBatch(writer)
              .option("checkpointLocation", config.checkpoint_location)
              .queryName(f"onceq-pipeline-{config.topic}"))
    if config.trigger == AVAILABLE_NOW:
        return stream.trigger(availableNow=True)
    return stream.trigger(processingTime=config.trigger)


def _report(progress: Any, writer: _BatchWriter) -> BatchReport | None:
    """A batch's report from Spark's progress and the writer's outcome."""
    bid = progress.batchId
    with writer._lock:
        got = writer.outcomes.pop(bid, None)
    if got is None:
        return None
    outcome, written, duration = got
    metrics = progress.observedMetrics.get("onceq_pipeline_input")
    rows = int(metrics["rows"] or 0) if metrics is not None else int(progress.numInputRows)
    malformed = int(metrics["malformed"] or 0) if metrics is not None else 0
    late = sum(int(op.numRowsDroppedByWatermark or 0) for op in progress.stateOperators)
    return BatchReport(bid, rows, malformed, late, max(0, rows - malformed - late - written),
                       outcome.late_duplicates, outcome.orders_new, outcome.products,
                       outcome.replayed, duration)


SINK_RECORD = "onceq-pipeline-sink.json"  # in the checkpoint directory
LEGACY_DEFAULT = "onceq-pipeline-checkpoint"  # the default of earlier versions, for any sink


def claim_checkpoint(spark: Any, config: PipelineConfig) -> None:
    """Record in the checkpoint directory which database and tables its progress is for,
    or check the record: a checkpoint with progress for another sink is refused
    (``CheckpointMismatch``). One without progress is claimed again (a first run that
    failed before its first batch binds nothing)."""
    location = config.checkpoint_location
    files = _CheckpointFiles(spark, location)
    if config.checkpoint is None and not files.has_progress():
        legacy = os.path.abspath(LEGACY_DEFAULT)
        if _CheckpointFiles(spark, legacy).has_progress():
            raise CheckpointMismatch(
                f"{legacy} holds the progress of a pipeline started with the one default "
                "checkpoint that every database shared; the default is now one per "
                f"database ({location}). Pass --checkpoint {legacy} to go on from it if it "
                "was written for this database, or move it away to start afresh.")
    mine = sink_identity(config.database, config.table_prefix)
    text = files.read(SINK_RECORD)
    if text is not None:
        try:
            recorded = json.loads(text)
        except ValueError:
            recorded = None
        if recorded == mine:
            return
        if files.has_progress():
            theirs = (f"{recorded.get('database')} (tables {recorded.get('table_prefix')}_*)"
                      if isinstance(recorded, dict) else f"an unreadable {SINK_RECORD}")
            raise CheckpointMismatch(
                f"checkpoint {location} holds the progress of a pipeline into {theirs}, not "
                f"{mine['database']} (tables {mine['table_prefix']}_*): continuing from it "
                "would skip every order it read. Use another checkpoint for this database "
                "(the default one is derived from the database, prefix and topic).")
    files.write(SINK_RECORD, json.dumps(mine, sort_keys=True) + "\n")


class _CheckpointFiles:
    """Small files in a checkpoint directory, through Hadoop's file system API (as Spark
    reaches the checkpoint: a local path, HDFS, S3...)."""

    def __init__(self, spark: Any, location: str) -> None:
        sc = spark.sparkContext
        self._jvm = sc._jvm
        self.root = self._jvm.org.apache.hadoop.fs.Path(location)
        self.fs = self.root.getFileSystem(sc._jsc.hadoopConfiguration())

    def _path(self, name: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self.root, name)

    def read(self, name: str) -> str | None:
        path = self._path(name)
        if not self.fs.exists(path):
            return None
        stream = self.fs.open(path)
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def write(self, name: str, text: str) -> None:
        self.fs.mkdirs(self.root)
        out = self.fs.create(self._path(name), True)
        try:
            out.write(bytearray(text.encode()))
        finally:
            out.close()

    def has_progress(self) -> bool:
        """Spark recorded a batch's offsets here (the ``offsets`` log is not empty)."""
        offsets = self._path("offsets")
        return bool(self.fs.exists(offsets)) and any(
            s.getPath().getName().isdigit() for s in self.fs.listStatus(offsets))


def check_broker(config: PipelineConfig) -> None:
    """Raise what the source would meet first: a ``ConnectionLost`` when the broker is out
    of reach, an ``OnceqError`` when it refuses the topic (TOPIC_NOT_EXIST). No retry: a
    command reports this at once rather than waiting out the read timeout."""
    from ..client.sync import SyncPullConsumer

    with SyncPullConsumer(config.servers) as client:
        client.queue_count(config.topic)


# the last line of a Python traceback: ``module.Name: message``
_RAISED = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Lost|Interrupt|Exit)): (.+)$")
_CODED = re.compile(r"^([A-Z][A-Z_]+) \((\d+)\): (.+)$")  # OnceqError's text
_FOREIGN = ("pyspark.", "py4j.", "java.", "javax.", "org.apache.", "scala.")


def query_error(exc: BaseException) -> PipelineError:
    """The query's failure as one line. Spark carries a Python error raised in the source or
    in ``foreachBatch`` as the text of its traceback: its last ``Name: message`` line is the
    error; an onceq error's code is read back from it."""
    lines = [line.strip() for line in str(exc).splitlines()]
    raised = [m for line in lines if not line.startswith(_FOREIGN)
              and (m := _RAISED.match(line)) is not None]
    if not raised:
        first = next((line for line in lines if line), type(exc).__name__)
        return PipelineError(f"the pipeline's query failed: {first}")
    name, message = raised[-1].group(1), raised[-1].group(2)
    coded = _CODED.match(message)
    if coded is not None and coded.group(1) in ErrorCode.__members__:
        code, text = ErrorCode[coded.group(1)], coded.group(3)
        broker = ConnectionLost(text, code) if name == "ConnectionLost" else OnceqError(
            code, text)
        return PipelineError(f"the pipeline's query failed: {broker}", broker)
    return PipelineError(f"the pipeline's query failed: {name}: {message}")


def run_pipeline(spark: Any, config: PipelineConfig, *,
                 on_batch: Callable[[BatchReport], None] | None = None,
                 stop: threading.Event | None = None) -> PipelineResult:
    """Run the pipeline on ``spark`` until the trigger ends it (available-now), ``timeout_s``
    passes or ``stop`` is set. ``on_batch`` gets each batch's report as it finishes
    (default: a progress line on the ``onceq.spark.pipeline`` logger). Restarting with the
    same checkpoint and database continues where the last run stopped.

    Raises ``CheckpointMismatch`` for a checkpoint with the progress of another database or
    table set, and ``PipelineError`` when the query fails (its ``broker_error`` says when
    the broker was the cause)."""
    from pyspark.errors import StreamingQueryException

    import onceq.spark

    onceq.spark.register(spark)
    if config.shuffle_partitions is not None:
        spark.conf.set("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
    report = on_batch or (lambda b: log.info("%s", b.line()))
    store = InventoryStore(config.database, config.table_prefix)
    try:
        claim_checkpoint(spark, config)
        writer = _BatchWriter(config, store)
        query = _plan(spark, config, writer).start()
        result = PipelineResult(str(query.id))
        deadline = None if config.timeout_s is None else time.monotonic() + config.timeout_s
        seen: set[int] = set()
        try:
            while True:
                active = query.isActive
                for p in query.recentProgress:
                    if p.batchId not in seen:
                        b = _report(p, writer)
                        if b is not None:
                            seen.add(p.batchId)
                            result.batches.append(b)
                            report(b)
                if not active:
                    break
                if (stop is not None and stop.is_set()) or (
                        deadline is not None and time.monotonic() >= deadline):
                    query.stop()
                    continue  # one more look at the progress
                # a failed query raises here: its progress is read once more, then its error
                with contextlib.suppress(StreamingQueryException):
                    query.awaitTermination(0.1)
        finally:
            if query.isActive:
                query.stop()
        # a batch stopped after its database commit but before Spark recorded it: it has
        # no progress, yet its effects are in; the next run gets it again as a replay
        with writer._lock:
            unfinished = sorted(writer.outcomes.items())
            writer.outcomes.clear()
        for bid, (outcome, written, duration) in unfinished:
            b = BatchReport(bid, written, 0, 0, 0, outcome.late_duplicates, outcome.orders_new,
                            outcome.products, outcome.replayed, duration,
                            from_progress=False)
            result.batches.append(b)
            report(b)
        exc = query.exception()
        if exc is not None:
            raise query_error(exc) from None
        result.totals = store.totals()
        return result
    finally:
        store.close()
