"""The onceq sink: what it writes, and exactly once across task retries, batch replays
long after the dedup window, and a broker killed in between."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from onceq.client.sync import SyncProducer, SyncPullConsumer
from tests.helpers import free_port, spawn_broker

from .conftest import create_topic
from .sink_retry_proc import PAD

pytestmark = pytest.mark.timeout(300)


def read_all(spark, addr: str, topic: str) -> list:
    return (spark.read.format("onceq").option("servers", addr).option("topic", topic)
            .load().collect())


def write(df, addr: str, topic: str, **options) -> None:
    w = df.write.format("onceq").option("servers", addr).option("topic", topic)
    for k, v in options.items():
        w = w.option(k, v)
    w.mode("append").save()


def test_batch_write_stores_every_column_once(spark, broker_addr):
    topic = "k_batch"
    create_topic(broker_addr, topic, 4)
    n = 3000
    df = (spark.range(0, n, 1, 3).select(
        F.concat(F.lit("v"), F.col("id").cast("string")).alias("body"),
        F.array(F.concat(F.lit("k"), F.col("id").cast("string")), F.lit("all")).alias("keys"),
        F.when(F.col("id") % 2 == 0, F.lit("even")).alias("tags"),
        F.create_map(F.lit("id"), F.col("id").cast("string")).alias("properties"),
        F.when(F.col("id") % 5 == 0, F.lit(3)).alias("queue"),
        F.when(F.col("id") % 5 == 1, F.concat(F.lit("s"), (F.col("id") % 7).cast("string")))
        .alias("sharding_key")))
    write(df, broker_addr, topic, batchSize="200")
    rows = read_all(spark, broker_addr, topic)
    assert len(rows) == n
    assert len({r["unique_key"] for r in rows}) == n
    marked = 0
    for r in rows:
        i = int(bytes(r["body"])[1:])
        assert r["keys"] == f"k{i} all"
        assert r["tags"] == ("even" if i % 2 == 0 else "")
        props = dict(r["properties"])
        marked += props.pop("WRITER_SEQ", None) is not None  # the last of each send
        assert props == {"id": str(i)}
        if i % 5 == 0:
            assert r["queue"] == 3
        elif i % 5 == 1:  # the queue the producer picks for that sharding key
            assert r["queue"] == zlib.crc32(f"s{i % 7}".encode()) % 4
    assert {r["queue"] for r in rows} == {0, 1, 2, 3}
    assert n / 200 <= marked < n / 10

    # a write with a writer id, run again (a re-run job): the second run stores nothing
    small = spark.range(0, 500, 1, 2).select(F.col("id").cast("string").alias("body"))
    write(small, broker_addr, topic, writerId="nightly-2026-11-24")
    write(small, broker_addr, topic, writerId="nightly-2026-11-24")
    with SyncPullConsumer(broker_addr) as c:
        assert sum(c.queue_offsets(topic, q)[1] for q in range(4)) == n + 500


def test_bad_columns_and_options_are_clear_errors(spark, broker_addr):
    create_topic(broker_addr, "k_bad", 1)
    df = spark.range(3).select(F.col("id").cast("string").alias("body"),
                               F.col("id").alias("tag"))
    with pytest.raises(Exception, match="does not take column 'tag'"):
        write(df, broker_addr, "k_bad")
    with pytest.raises(Exception, match="needs a 'body' column"):
        write(spark.range(3), broker_addr, "k_bad")
    with pytest.raises(Exception, match="batchSize"):
        write(df.select("body"), broker_addr, "k_bad", batchSize="0")
    with pytest.raises(Exception, match="names queue 5"):
        write(df.select("body", F.lit(5).alias("queue")), broker_addr, "k_bad")


def _stream(spark, addr: str, src: str, dst: str, ckpt: Path) -> list[int]:
    q = (spark.readStream.format("onceq").option("servers", addr).option("topic", src)
         .option("startingOffsets", "earliest").option("maxMessagesPerTrigger", "250")
         .load().select("body", "keys", F.col("queue").alias("queue"))
         .writeStream.format("onceq").option("servers", addr).option("topic", dst)
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert not q.isActive
    if q.exception() is not None:
        raise AssertionError(str(q.exception()))
    return [p["numInputRows"] for p in q.recentProgress]


@pytest.mark.slow
def test_stream_replay_after_dedup_window_and_broker_kill_stores_once(spark, tmp_path):
    """Batches replayed after the broker's dedup window expired and after the broker was
    killed (SIGKILL) and restarted: each row is stored once."""
    data, port = str(tmp_path / "broker"), free_port()
    proc, addr = spawn_broker(data, "--dedup-window", "0.5", port=port)
    try:
        src, dst = "k_src", "k_dst"
        create_topic(addr, src, 2)
        create_topic(addr, dst, 2)
        with SyncProducer(addr) as p:
            for i in range(400):
                p.send(src, f"e{i}".encode(), queue=i % 2)
        ckpt = tmp_path / "ckpt"
        first = _stream(spark, addr, src, dst, ckpt)
        assert sum(first) == 400 and len([n for n in first if n]) == 2

        proc.kill()  # SIGKILL: the sequence table is rebuilt at restart
        proc.wait(10)
        time.sleep(0.6)  # and the dedup window is over (the broker process's own clock)
        proc, addr = spawn_broker(data, "--dedup-window", "0.5", port=port)
        # forget that the last batch was committed: the restart replays it
        last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
        for name in (str(last), f".{last}.crc"):
            (ckpt / "commits" / name).unlink(missing_ok=True)
        replayed = _stream(spark, addr, src, dst, ckpt)
        assert sum(replayed) == first[-1] > 0

        rows = read_all(spark, addr, dst)
        bodies = sorted(bytes(r["body"]) for r in rows)
        assert bodies == sorted(f"e{i}".encode() for i in range(400))
        assert all(r["queue"] == int(bytes(r["body"])[1:]) % 2 for r in rows)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_task_failure_and_retry_store_each_row_once(broker_addr, tmp_path):
    """In its own Spark (local[2,4]); every task fails once after some rows were stored."""
    topic, queues, rows = "k_retry", 3, 60_000
    create_topic(broker_addr, topic, queues)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.run([sys.executable, "-m", "tests.spark.sink_retry_proc", broker_addr,
                           topic, str(queues), str(rows), str(marks)],
                          capture_output=True, env=env, timeout=240,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    failed = {p.name: int(p.read_text()) for p in marks.iterdir()}
    assert set(failed) == {"p0", "p1"}  # both tasks failed once...
    assert max(failed.values()) > 0  # ...after the broker had stored some of their rows

    bodies = []
    with SyncPullConsumer(broker_addr) as c:
        for q in range(queues):
            offset = 0
            while True:
                got = c.pull(topic, q, offset, 1000)
                if not got.messages:
                    break
                bodies += [m.body for m in got.messages]
                offset = got.next_offset
    assert sorted(bodies) == sorted(f"row-{i}".ljust(PAD, ".").encode() for i in range(rows))
