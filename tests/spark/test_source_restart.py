"""The source rides out a broker restart (SIGKILL, then a new broker process on the same
data and port): planning on the driver and reads on the executors retry within
readTimeout, and every message still arrives once; a broker that stays away fails the
read with a clear error."""

from __future__ import annotations

import threading
import time

import pytest

from onceq.client.connection import ConnectionLost
from onceq.spark.pulling import QueueRange, read_range
from tests.helpers import free_port, spawn_broker

from .conftest import create_topic
from .test_source import as_sent, produce

pytestmark = pytest.mark.timeout(300)


class RestartableBroker:
    """A broker child process on a fixed port and data directory."""

    def __init__(self, data: str) -> None:
        self.data, self.port = data, free_port()
        self.proc, self.addr = spawn_broker(data, port=self.port)
        self.restarting: threading.Thread | None = None

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no shutdown, as a crash
        self.proc.wait(10)

    def start(self) -> None:
        self.proc, _ = spawn_broker(self.data, port=self.port)

    def restart_later(self, down_s: float) -> threading.Thread:
        """Kill now; start again ``down_s`` seconds later, in a thread."""
        self.kill()

        def start() -> None:
            time.sleep(down_s)
            self.start()

        self.restarting = threading.Thread(target=start, daemon=True)
        self.restarting.start()
        return self.restarting

    def stop(self) -> None:
        if self.restarting is not None:
            self.restarting.join(30)  # a broker started late is stopped too
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def broker(tmp_path):
    b = RestartableBroker(str(tmp_path / "broker"))
    yield b
    b.stop()


def test_a_range_read_rides_out_a_broker_restart(broker):
    """The executor's side: the pull that fails is sent again from the first offset not
    yet handed out, on a new connection, once the broker is back."""
    topic = "r_range"
    create_topic(broker.addr, topic, 1)
    sent = produce(broker.addr, topic, 600)
    batches = read_range(QueueRange(broker.addr, "g", topic, 0, 0, 600, pull_batch=50))
    rows = next(batches).to_pylist()
    restarted = broker.restart_later(1.0)
    for batch in batches:
        rows += batch.to_pylist()
    restarted.join(30)
    assert [r["offset"] for r in rows] == list(range(600))  # no gap, nothing twice
    assert as_sent(rows) == sent


def test_a_broker_that_stays_away_fails_the_read_clearly(spark):
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost, match=r"reading t/0 .* failed every attempt for 1 s "
                                             r"\(option readTimeout\): cannot connect"):
        list(read_range(QueueRange(dead, "g", "t", 0, 0, 10, timeout_s=1)))
    # the driver's planning: the same limit, the same message, through Spark
    with pytest.raises(Exception, match=r"planning t at .* failed every attempt for 1 s "
                                        r"\(option readTimeout\): cannot connect"):
        (spark.read.format("onceq").option("servers", dead).option("topic", "t")
         .option("readTimeout", "1").load().collect())
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_stream_survives_a_broker_restart_and_reads_each_message_once(spark, broker, tmp_path):
    topic = "r_stream"
    create_topic(broker.addr, topic, 2)
    sent = produce(broker.addr, topic, 300)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    q = (spark.readStream.format("onceq").option("servers", broker.addr)
         .option("topic", topic).option("startingOffsets", "earliest")
         .option("maxMessagesPerTrigger", "30").option("pullBatchSize", "10").load()
         .writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(ckpt)).start())
    try:
        deadline = time.monotonic() + 120
        while q.isActive and len(q.recentProgress) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert q.isActive and len(q.recentProgress) >= 2, q.exception()
        broker.restart_later(1.0).join(30)  # mid-stream: 300 messages, 30 per batch
        sent.update(produce(broker.addr, topic, 100, start=300))
        q.processAllAvailable()  # raises if the query failed
        assert q.isActive and q.exception() is None
    finally:
        q.stop()
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 400 and as_sent(rows) == sent  # every message, none twice
