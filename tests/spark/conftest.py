"""One SparkSession for all Spark tests (starting one costs seconds), and brokers."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading

import pytest

pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17+", allow_module_level=True)

from onceq.client.admin import Admin
from tests.helpers import running_broker, spawn_broker


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from pyspark.sql import SparkSession

    import onceq.spark

    # executors' Python workers must run this interpreter (it has onceq installed)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master("local[2]").appName("onceq-tests")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
               .config("spark.local.dir", str(tmp_path_factory.mktemp("spark-local"))))
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # the JVM's launcher died before it started (once seen in
        # a worker that had run gRPC servers): one more start, said on stderr
        print(f"starting Spark failed ({exc}); starting it again", file=sys.stderr)
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    onceq.spark.register(session)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def broker_addr(tmp_path_factory):
    """A broker in a child process, shared by the Spark tests (each uses its own topic)."""
    proc, addr = spawn_broker(str(tmp_path_factory.mktemp("broker") / "data"))
    yield addr
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def retention_broker(tmp_path):
    """A broker in a thread of this process that deletes old segments every 0.2 s: small
    segments, little kept. Yields its address."""
    ready = threading.Event()
    stop: dict[str, asyncio.Event] = {}
    box: dict[str, str] = {}

    async def main() -> None:
        async with running_broker(str(tmp_path / "data"),
                                  store_kw={"segment_size": 64 * 1024, "max_body": 16 * 1024,
                                            "retention_bytes": 128 * 1024},
                                  retention_check_s=0.2) as b:
            box["addr"] = f"127.0.0.1:{b.port}"
            stop["ev"] = asyncio.Event()
            ready.set()
            await stop["ev"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "broker did not start"
    yield box["addr"]
    loop.call_soon_threadsafe(stop["ev"].set)
    thread.join(10)
    loop.close()


def create_topic(addr: str, topic: str, queues: int) -> None:
    async def go() -> None:
        async with Admin(addr) as admin:
            await admin.create_topic(topic, queues)
    asyncio.run(go())
