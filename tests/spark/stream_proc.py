"""A streaming query in its own process (own Spark JVM), to be killed: args are the broker
address, topic, output and checkpoint directories. Runs until killed."""

from __future__ import annotations

import os
import sys
import time

from pyspark.sql import SparkSession

import onceq.spark


def main() -> None:
    addr, topic, out, ckpt = sys.argv[1:5]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    onceq.spark.register(spark)
    (spark.readStream.format("onceq").option("servers", addr).option("topic", topic)
     .option("startingOffsets", "earliest").option("maxMessagesPerTrigger", "40").load()
     .writeStream.format("parquet").option("path", out)
     .option("checkpointLocation", ckpt).start())
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
