"""Rows/s from the onceq streaming source into Spark's noop sink, next to a synthetic
pure-Python source yielding the same schema as Arrow record batches (the ceiling of a
Python data source on this machine).

A broker in its own process (async flush), a topic of --queues queues holding --n messages
of 100 bytes (produced first). Spark runs ``local[2]``; each source is read once with
``Trigger.AvailableNow`` after a small warm-up query (Python workers started). Rows/s is
--n / (query start to termination).

Usage: python benchmarks/spark_source.py [--n 500000] [--queues 4]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "spark_bench"


async def _produce(addr: str, n: int, queues: int) -> None:
    from onceq import Admin, Producer

    async with Admin(addr) as a:
        await a.create_topic(TOPIC, queues)
    body = b"x" * 100
    async with Producer(addr) as p:
        per = n // queues
        for q in range(queues):
            left = per + (1 if q < n % queues else 0)
            while left:
                k = min(512, left)
                await p.send_batch(TOPIC, [body] * k, queue=q)
                left -= k


def _synthetic_source(n: int, parts: int):
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

    from onceq.client.message import MessageExt
    from onceq.spark.arrow import SCHEMA_DDL, to_record_batch

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def initialOffset(self):
            return {"rows": 0}

        def prepareForTriggerAvailableNow(self):
            pass

        def latestOffset(self, start, limit):
            return {"rows": n}

        def partitions(self, start, end):
            rows = end["rows"] - start["rows"]
            return [InputPartition((i, rows // parts)) for i in range(parts)]

        def read(self, partition):
            q, rows = partition.value
            msgs = [MessageExt(TOPIC, q, i, b"x" * 100, "K" * 32, born_ts_ms=1, store_ts_ms=1)
                    for i in range(1024)]
            batch = to_record_batch(msgs)
            for _ in range(rows // 1024):
                yield batch
            if rows % 1024:
                yield batch.slice(0, rows % 1024)

        def commit(self, end):
            pass

    class Synthetic(DataSource):
        @classmethod
        def name(cls):
            return "synthetic"

        def schema(self):
            return SCHEMA_DDL

        def streamReader(self, schema):
            return Reader()

    return Synthetic


def _run(spark, fmt: str, options: dict[str, str], ckpt: str) -> float:
    r = spark.readStream.format(fmt)
    for k, v in options.items():
        r = r.option(k, v)
    t0 = time.perf_counter()
    q = (r.load().writeStream.format("noop").option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    while not q.awaitTermination(2):  # a line every 2 s while the query runs
        note(f"  {fmt}: query running for {time.perf_counter() - t0:.0f}s")
    elapsed = time.perf_counter() - t0
    if q.exception() is not None:
        raise RuntimeError(str(q.exception()))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500_000)
    ap.add_argument("--queues", type=int, default=4)
    args = ap.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    steps = Steps(5)
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_broker(os.path.join(tmp, "data"), "async")
        try:
            steps.next(f"producing {args.n} messages to {args.queues} queues")
            t0 = time.perf_counter()
            asyncio.run(_produce(addr, args.n, args.queues))
            produce_s = time.perf_counter() - t0

            steps.next("starting Spark (local[2])")
            from pyspark.sql import SparkSession

            import onceq.spark
            spark = (SparkSession.builder.master("local[2]")
                     .config("spark.sql.shuffle.partitions", "2")
                     .config("spark.ui.enabled", "false")
                     .config("spark.ui.showConsoleProgress", "false").getOrCreate())
            spark.sparkContext.setLogLevel("ERROR")
            onceq.spark.register(spark)
            spark.dataSource.register(_synthetic_source(args.n, args.queues))
            onceq_opts = {"servers": addr, "topic": TOPIC, "startingOffsets": "earliest"}
            steps.next("warm-up read (Python workers start)")
            # warm-up: Python workers start with the first read
            (spark.read.format("onceq").options(**onceq_opts, queues="0",
                                                 endingOffsets=f'{{"{TOPIC}": {{"0": 1000}}}}')
             .load().count())
            steps.next(f"synthetic source: {args.n} rows")
            synthetic_s = _run(spark, "synthetic", {}, os.path.join(tmp, "c1"))
            steps.next(f"onceq source: {args.n} rows")
            onceq_s = _run(spark, "onceq", onceq_opts, os.path.join(tmp, "c2"))
            spark.stop()
        finally:
            proc.terminate()
            proc.wait(10)
    print(json.dumps({
        "n": args.n, "queues": args.queues, "spark_master": "local[2]",
        "produce_s": round(produce_s, 2),
        "synthetic_rows_per_s": round(args.n / synthetic_s),
        "onceq_rows_per_s": round(args.n / onceq_s),
        "onceq_vs_synthetic": round(synthetic_s / onceq_s, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
