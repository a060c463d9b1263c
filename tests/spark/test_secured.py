"""The Spark source and sink against a broker with ACLs on: credentials given as options
(``user``/``password`` or ``credentialsFile``), none from the environment; without them
the read fails with a clear error."""

from __future__ import annotations

import asyncio
import os

import pytest
from pyspark.sql import functions as F

from onceq import Admin, ClientSecurity
from onceq.broker.users import UserStore
from onceq.client.sync import SyncPullConsumer
from tests.helpers import spawn_broker

TOPIC = "secured"


@pytest.fixture
def acl_broker(tmp_path, monkeypatch):
    for var in ("ONCEQ_USER", "ONCEQ_PASSWORD", "ONCEQ_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    data = tmp_path / "data"
    data.mkdir()
    UserStore(str(data)).create("etl", "etl-password", super=True)
    proc, addr = spawn_broker(str(data), "--acl")
    try:
        async def setup() -> None:
            async with Admin(addr, security=ClientSecurity("etl", "etl-password")) as a:
                await a.create_topic(TOPIC, 2)

        asyncio.run(setup())
        yield addr
    finally:
        proc.terminate()
        proc.wait(10)


def test_source_and_sink_take_credentials_as_options(spark, acl_broker, tmp_path):
    creds = tmp_path / "creds"
    creds.write_text("etl:etl-password\n")
    os.chmod(creds, 0o600)
    df = spark.range(0, 200, 1, 2).select(F.col("id").cast("string").alias("body"))
    (df.write.format("onceq").option("servers", acl_broker).option("topic", TOPIC)
     .option("user", "etl").option("password", "etl-password").mode("append").save())
    rows = (spark.read.format("onceq").option("servers", acl_broker).option("topic", TOPIC)
            .option("credentialsFile", str(creds)).load().collect())
    assert sorted(int(bytes(r["body"])) for r in rows) == list(range(200))
    with SyncPullConsumer(acl_broker, security=ClientSecurity("etl", "etl-password")) as c:
        assert sum(c.queue_offsets(TOPIC, q)[1] for q in range(2)) == 200


def test_without_credentials_the_read_fails_clearly(spark, acl_broker):
    with pytest.raises(Exception, match="UNAUTHENTICATED"):
        (spark.read.format("onceq").option("servers", acl_broker).option("topic", TOPIC)
         .option("readTimeout", "1").load().collect())
