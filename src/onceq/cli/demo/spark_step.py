"""The Spark step: the exactly-once pipeline (``onceq.spark.pipeline``) reads the same
topic into the inventory table, is stopped after its first micro-batch and restarted from
its checkpoint, and its totals are checked against the orders sent.

The session starts in a background thread while the consumer group runs (a JVM takes
seconds to start); ``SparkStep.available()`` says why the step cannot run (no pyspark, no
Java) instead of failing the demo.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .member import TOPIC
from .shop import Order

# Spark's own log goes to a file in the work dir, not over the live progress
_LOG4J = """\
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{HH:mm:ss}} %p %c{{1}}: %m%n
"""


@dataclass
class SparkOutcome:
    runs: int = 0
    batches: list[dict[str, Any]] = field(default_factory=list)
    rows_in: int = 0
    duplicates_dropped: int = 0
    orders_counted: int = 0
    replayed_batches: int = 0
    totals_match: bool = False  # the inventory table equals the orders, each counted once
    inventory: dict[str, tuple[int, int]] = field(default_factory=dict)
    expected: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0


def count_batches(batches: list[dict[str, Any]]) -> tuple[int, int]:
    """Rows read and duplicates dropped over both runs, each micro-batch once: a batch
    Spark ran again after the stop (its commit lost, or it ran before its report) read the
    same rows and dropped the same duplicates; its first report with Spark's progress counts
    (one made without it, for a batch stopped before Spark recorded it, knows only the rows
    written, not those Spark dropped)."""
    first: dict[int, dict[str, Any]] = {}
    for b in batches:
        seen = first.get(b["batch"])
        if seen is None or (not seen.get("from_progress", True)
                            and b.get("from_progress", True)):
            first[b["batch"]] = b
    return (sum(b["rows_in"] for b in first.values()),
            sum(b["spark_duplicates"] + b["late_duplicates"] for b in first.values()))


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (pip install 'onceq[spark]')"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Java 17+ is not installed"
    return None


class SparkStep:
    def __init__(self, workdir: str, session: Any = None) -> None:
        """``session``: a SparkSession to use (default: ``start_session`` makes one)."""
        self.workdir = workdir
        self._session: Future[Any] = Future()
        self._own = session is None
        if session is not None:
            self._session.set_result(session)
        self.progress: list[str] = []

    def start_session(self) -> None:
        """Start the local Spark session in a background thread."""
        def run() -> None:
            try:
                from ...spark.pipeline import local_spark

                log4j = Path(self.workdir) / "log4j2.properties"
                log4j.write_text(_LOG4J.format(log=Path(self.workdir) / "spark.log"))
                # read by pyspark when it launches the JVM (unless the user set it)
                os.environ.setdefault(
                    "PYSPARK_SUBMIT_ARGS", "--driver-java-options "
                    f"-Dlog4j2.configurationFile={log4j.as_uri()} pyspark-shell")
                spark = local_spark(app="onceq-demo", shuffle_partitions=2)
                # start the Python workers now, while the consumer group runs
                spark.sparkContext.parallelize(range(2), 2).map(lambda x: x).count()
                self._session.set_result(spark)
            except BaseException as exc:  # reported when the step runs
                self._session.set_exception(exc)
        threading.Thread(target=run, name="spark-session", daemon=True).start()

    async def run(self, broker: str, orders: list[Order], stored: int, topic: str = TOPIC
                  ) -> SparkOutcome:
        """Run the pipeline twice over ``topic`` (``stored`` messages): the first run stops
        after one micro-batch, the second continues from the checkpoint."""
        return await asyncio.to_thread(self._run, broker, orders, stored, topic)

    def _run(self, broker: str, orders: list[Order], stored: int, topic: str
             ) -> SparkOutcome:
        import time

        from ...spark.pipeline import PipelineConfig, run_pipeline

        t0 = time.time()
        spark = self._session.result()
        out = SparkOutcome()
        config = PipelineConfig(
            servers=broker, topic=topic, checkpoint=f"{self.workdir}/spark-checkpoint",
            database=f"sqlite:///{self.workdir}/inventory.db",
            max_messages_per_trigger=stored // 2 + 1)
        for run in (1, 2):
            stop = threading.Event()

            def on_batch(b: Any, run: int = run, stop: threading.Event = stop) -> None:
                out.batches.append({"run": run, "batch": b.batch_id, "rows_in": b.rows_in,
                                    "spark_duplicates": b.spark_duplicates,
                                    "late_duplicates": b.late_duplicates,
                                    "orders_new": b.orders_new, "replayed": b.replayed,
                                    "from_progress": b.from_progress})
                self.progress.append(f"run {run}: {b.line()}")
                if run == 1:
                    stop.set()  # stop after the first batch; run 2 restarts from the checkpoint

            result = run_pipeline(spark, config, on_batch=on_batch, stop=stop)
            out.runs += 1
            out.orders_counted += result.orders_counted
            out.replayed_batches += result.replayed_batches
            out.inventory = {p: (t.quantity, t.orders) for p, t in result.totals.items()}
        out.rows_in, out.duplicates_dropped = count_batches(out.batches)
        qty: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for o in orders:
            qty[o.item] += o.qty
            count[o.item] += 1
        out.expected = {p: (qty[p], count[p]) for p in sorted(qty)}
        out.totals_match = out.inventory == out.expected
        out.seconds = time.time() - t0
        return out

    def stop(self) -> None:
        if self._own and self._session.done() and self._session.exception() is None:
            self._session.result().stop()
