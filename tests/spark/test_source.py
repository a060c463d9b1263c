"""The onceq data source against a real broker, on one shared local SparkSession."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.sync import SyncProducer, SyncPullConsumer

from .conftest import create_topic

pytestmark = pytest.mark.timeout(300)

COLUMNS = ["body", "keys", "tags", "properties", "unique_key", "topic", "queue", "offset",
           "born_timestamp", "store_timestamp", "reconsume_count"]


def produce(addr: str, topic: str, n: int, start: int = 0, body_size: int = 0) -> dict:
    """Send n messages; returns {(queue, offset): (body, keys, tags, properties, key)}."""
    sent = {}
    with SyncProducer(addr) as p:
        for i in range(start, start + n):
            body = f"m{i}".encode().ljust(body_size, b".")
            msg = Message(body, tags=f"T{i % 3}", keys=f"k{i} order-{i % 7}",
                          properties={"i": str(i), "even": str(i % 2 == 0)})
            r = p.send(topic, msg)
            sent[(r.queue_id, r.offset)] = (body, msg.keys, msg.tags, dict(msg.properties),
                                            r.unique_key)
    return sent


def as_sent(rows) -> dict:
    return {(r["queue"], r["offset"]): (bytes(r["body"]), r["keys"], r["tags"],
                                        dict(r["properties"]), r["unique_key"]) for r in rows}


def reader(spark, addr: str, topic: str | None, **options):
    """A batch read of ``topic`` (None: the options name the topics)."""
    r = spark.read.format("onceq").option("servers", addr)
    r = r if topic is None else r.option("topic", topic)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_of_all_queues_equals_what_was_sent(spark, broker_addr):
    create_topic(broker_addr, "b_all", 4)
    before = time.time()
    sent = produce(broker_addr, "b_all", 200)
    df = reader(spark, broker_addr, "b_all")
    assert df.columns == COLUMNS
    assert df.rdd.getNumPartitions() == 4  # one input partition per queue
    rows = df.collect()
    assert len(rows) == 200
    assert as_sent(rows) == sent
    assert {r["topic"] for r in rows} == {"b_all"}
    assert {r["reconsume_count"] for r in rows} == {0}
    for r in rows:
        assert before - 1 <= r["born_timestamp"].timestamp() <= r["store_timestamp"].timestamp()
        assert r["store_timestamp"].timestamp() <= time.time() + 1


def test_batch_offset_ranges_queues_and_timestamp(spark, broker_addr):
    create_topic(broker_addr, "b_ranges", 3)
    first = produce(broker_addr, "b_ranges", 60)
    time.sleep(0.05)
    cut_ms = int(time.time() * 1000)
    time.sleep(0.05)
    second = produce(broker_addr, "b_ranges", 30, start=60)
    sent = {**first, **second}

    # some queues, JSON positions per queue (-2 earliest, -1 latest), split partitions
    df = reader(spark, broker_addr, "b_ranges", queues="0,2",
                startingOffsets=json.dumps({"b_ranges": {"0": 5, "2": -2}}),
                endingOffsets=json.dumps({"b_ranges": {"0": 12, "2": -1}}),
                maxMessagesPerPartition="7")
    got = as_sent(df.collect())
    want = {k: v for k, v in sent.items()
            if (k[0] == 0 and 5 <= k[1] < 12) or k[0] == 2}
    assert got == want
    assert df.rdd.getNumPartitions() == 1 + -(-sum(1 for k in sent if k[0] == 2) // 7)

    # a start by store time: only what was sent after it
    got = as_sent(reader(spark, broker_addr, "b_ranges",
                         startingTimestamp=str(cut_ms)).collect())
    assert got == second

    # nothing to read: an empty frame, not an error
    assert reader(spark, broker_addr, "b_ranges", startingOffsets="latest").count() == 0


def _run_available_now(spark, addr, topic, out, checkpoint, **options):
    r = spark.readStream.format("onceq").option("servers", addr)
    r = r if topic is None else r.option("topic", topic)
    for k, v in options.items():
        r = r.option(k, v)
    q = (r.load().writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert not q.isActive
    if q.exception() is not None:
        raise AssertionError(str(q.exception()))
    return [p["numInputRows"] for p in q.recentProgress]


def _group_offsets(addr: str, group: str, topic: str, queues: int) -> dict[int, int]:
    with SyncPullConsumer(addr, group) as c:
        return {q: c.fetch_offset(topic, q) for q in range(queues)}


def _max_offsets(addr: str, topic: str, queues: int) -> dict[int, int]:
    with SyncPullConsumer(addr) as c:
        return {q: c.queue_offsets(topic, q)[1] for q in range(queues)}


@pytest.mark.slow
def test_stream_available_now_with_admission_control_and_restart_reads_each_once(
        spark, broker_addr, tmp_path):
    topic, group = "s_once", "spark-s-once"
    create_topic(broker_addr, topic, 3)
    sent = produce(broker_addr, topic, 250)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    opts = {"startingOffsets": "earliest", "maxMessagesPerTrigger": "70", "group": group}

    rows = _run_available_now(spark, broker_addr, topic, out, ckpt, **opts)
    assert sum(rows) == 250
    assert max(rows) <= 70 and len([n for n in rows if n]) >= 4  # admission control
    table = pq.read_table(str(out)).to_pylist()
    assert as_sent(table) == sent

    # the broker shows the query's progress under its group: no lag left
    maxes = _max_offsets(broker_addr, topic, 3)
    assert _group_offsets(broker_addr, group, topic, 3) == maxes

    async def status():
        async with Admin(broker_addr) as a:
            return await a.group_status(group)
    assert asyncio.run(status()).lag == 0

    # more messages, then a restart from the checkpoint: only the new ones, once each
    sent.update(produce(broker_addr, topic, 120, start=250))
    rows = _run_available_now(spark, broker_addr, topic, out, ckpt, **opts)
    assert sum(rows) == 120
    table = pq.read_table(str(out)).to_pylist()
    assert len(table) == 370
    assert as_sent(table) == sent  # every message, none twice
    for q in range(3):
        offsets = sorted(r["offset"] for r in table if r["queue"] == q)
        assert offsets == list(range(len(offsets)))  # no gaps
    assert _group_offsets(broker_addr, group, topic, 3) == _max_offsets(broker_addr, topic, 3)


def test_stream_starts_latest_by_default(spark, broker_addr, tmp_path):
    topic = "s_latest"
    create_topic(broker_addr, topic, 2)
    produce(broker_addr, topic, 20)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    assert sum(_run_available_now(spark, broker_addr, topic, out, ckpt)) == 0
    sent = produce(broker_addr, topic, 10, start=20)
    assert sum(_run_available_now(spark, broker_addr, topic, out, ckpt)) == 10
    assert as_sent(pq.read_table(str(out)).to_pylist()) == sent

    # a queue added to the topic is read from its start
    create_topic(broker_addr, topic, 3)
    with SyncProducer(broker_addr) as p:
        for i in range(4):
            r = p.send(topic, Message(f"new{i}".encode()), queue=2)
            sent[(2, r.offset)] = (f"new{i}".encode(), "", "", {}, r.unique_key)
    assert sum(_run_available_now(spark, broker_addr, topic, out, ckpt)) == 4
    assert as_sent(pq.read_table(str(out)).to_pylist()) == sent


def _wait_for_retention(addr: str, topic: str, above: int) -> int:
    """The queue's first offset once retention moved it past ``above`` and then left it
    alone for a second (five retention passes): it deletes a segment per pass."""
    deadline = time.monotonic() + 20
    last, since = -1, time.monotonic()
    with SyncPullConsumer(addr) as c:
        while time.monotonic() < deadline:
            lo, _hi = c.queue_offsets(topic, 0)
            if lo != last:
                last, since = lo, time.monotonic()
            elif lo > above and time.monotonic() - since >= 1.0:
                return lo
            time.sleep(0.1)
    raise AssertionError(f"retention did not settle above offset {above} (at {last})")


def test_stream_data_loss_fails_clearly_or_skips(spark, retention_broker, tmp_path):
    addr, topic = retention_broker, "s_loss"
    create_topic(addr, topic, 1)
    first = produce(addr, topic, 5)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    opts = {"startingOffsets": "earliest", "group": "spark-loss"}
    assert sum(_run_available_now(spark, addr, topic, out, ckpt, **opts)) == 5

    later = produce(addr, topic, 100, start=5, body_size=4096)  # ~400 KiB: retention runs
    lo = _wait_for_retention(addr, topic, above=5)

    with pytest.raises(Exception, match=r"offsets 5\.\.\d+ of s_loss/0 .* were deleted"):
        _run_available_now(spark, addr, topic, out, ckpt, **opts)

    assert sum(_run_available_now(spark, addr, topic, out, ckpt, failOnDataLoss="false",
                                  **opts)) == 105 - lo
    kept = {k: v for k, v in later.items() if k[1] >= lo}
    assert as_sent(pq.read_table(str(out)).to_pylist()) == {**first, **kept}


def test_batch_data_loss(spark, retention_broker):
    addr, topic = retention_broker, "b_loss"
    create_topic(addr, topic, 1)
    sent = produce(addr, topic, 100, body_size=4096)
    lo = _wait_for_retention(addr, topic, above=0)
    from_zero = json.dumps({topic: {"0": 0}})
    with pytest.raises(Exception, match="failOnDataLoss=false"):
        reader(spark, addr, topic, startingOffsets=from_zero).collect()
    got = as_sent(reader(spark, addr, topic, startingOffsets=from_zero,
                         failOnDataLoss="false").collect())
    assert got == {k: v for k, v in sent.items() if k[1] >= lo}


@pytest.mark.slow
def test_stream_stopped_mid_stream_resumes_without_gaps_or_duplicates(
        spark, broker_addr, tmp_path):
    topic = "s_stop"
    create_topic(broker_addr, topic, 2)
    sent = produce(broker_addr, topic, 400)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = (spark.readStream.format("onceq").option("servers", broker_addr)
         .option("topic", topic).option("startingOffsets", "earliest")
         .option("maxMessagesPerTrigger", "40").load()
         .writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(ckpt)).start())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(q.recentProgress) < 2:
        time.sleep(0.05)
    q.stop()  # mid-stream, possibly mid-batch
    first_run = sum(p["numInputRows"] for p in q.recentProgress)
    assert 0 < first_run < 400
    rest = sum(_run_available_now(spark, broker_addr, topic, out, ckpt,
                                  maxMessagesPerTrigger="40"))
    # the file sink's log says which files belong to committed batches
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 400 and as_sent(rows) == sent
    assert first_run + rest >= 400  # a batch cut short by stop() is read again


@pytest.mark.slow
def test_stream_after_sigkill_of_the_spark_jvm_resumes_exactly(spark, broker_addr, tmp_path):
    topic = "s_kill"
    create_topic(broker_addr, topic, 2)
    sent = produce(broker_addr, topic, 400)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.spark.stream_proc", broker_addr, topic, str(out),
         str(ckpt)], start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 90
        commits = ckpt / "commits"
        while time.monotonic() < deadline and child.poll() is None and not (
                commits.is_dir() and len([p for p in commits.iterdir()
                                          if p.name.isdigit()]) >= 2):
            time.sleep(0.05)
        assert child.poll() is None, "the streaming process ended by itself"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the driver and its JVM, mid-stream
        child.wait(10)
    done = len([p for p in commits.iterdir() if p.name.isdigit()])
    assert 2 <= done < 10  # killed before the end (400 messages, 40 per batch)
    _run_available_now(spark, broker_addr, topic, out, ckpt, maxMessagesPerTrigger="40")
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 400 and as_sent(rows) == sent
