"""``df.write.format("onceq")`` in its own Spark (``local[2,4]``: failed tasks are retried),
where every task fails once after part of its rows were stored. Args: broker address,
topic, its queue count, rows, marker directory (a file per failed attempt, holding how many
messages the topic had when it failed)."""

from __future__ import annotations

import os
import sys
import time

from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType

import onceq.spark
from onceq.client.sync import SyncPullConsumer

PAD = 300


def main() -> None:
    addr, topic, marks = sys.argv[1], sys.argv[2], sys.argv[5]
    queues, rows = int(sys.argv[3]), int(sys.argv[4])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2,4]")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
             .config("spark.sql.execution.pythonUDF.arrow.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("OFF")
    onceq.spark.register(spark)

    def body(i: int) -> str:
        ctx = TaskContext.get()
        # the first attempt of each task fails two thirds into its rows: by then the
        # writer has sent (and the broker stored) the first batches
        if ctx.attemptNumber() == 0 and i % (rows // 2) == rows // 3:
            stored = 0
            deadline = time.monotonic() + 10
            with SyncPullConsumer(addr) as c:
                while not stored and time.monotonic() < deadline:
                    stored = sum(c.queue_offsets(topic, q)[1] for q in range(queues))
                    time.sleep(0.05)
            with open(os.path.join(marks, f"p{ctx.partitionId()}"), "w") as f:
                f.write(str(stored))
            raise RuntimeError("forced failure of a first attempt")
        return f"row-{i}".ljust(PAD, ".")  # Spark buffers a few MB between the UDF and
        # the writer: the rows must be larger than that for the failure to come late

    df = (spark.range(0, rows, 1, 2)
          .select(F.udf(body, StringType())("id").alias("body")))
    df.write.format("onceq").option("servers", addr).option("topic", topic) \
        .option("batchSize", "500").mode("append").save()
    spark.stop()


if __name__ == "__main__":
    main()
