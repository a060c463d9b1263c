"""The source over several topics (a list or a pattern) and with JSON bodies decoded."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pyarrow.parquet as pq
import pytest

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.sync import SyncProducer

from .conftest import create_topic
from .test_source import _run_available_now, as_sent, produce, reader

pytestmark = pytest.mark.timeout(300)


def test_batch_read_of_a_topic_list_and_a_pattern(spark, broker_addr):
    create_topic(broker_addr, "mt.eu", 2)
    create_topic(broker_addr, "mt.us", 3)
    create_topic(broker_addr, "mtx", 1)  # not matched by the pattern below
    eu, us = produce(broker_addr, "mt.eu", 30), produce(broker_addr, "mt.us", 40)
    produce(broker_addr, "mtx", 5)

    rows = reader(spark, broker_addr, None, topics="mt.eu,mt.us").collect()
    assert len(rows) == 70
    assert as_sent(r for r in rows if r["topic"] == "mt.eu") == eu
    assert as_sent(r for r in rows if r["topic"] == "mt.us") == us

    by_pattern = reader(spark, broker_addr, None, topicPattern=r"mt\.\w+")
    assert by_pattern.rdd.getNumPartitions() == 5  # one per queue of each topic
    assert sorted(r["topic"] for r in by_pattern.collect()) == sorted(
        ["mt.eu"] * 30 + ["mt.us"] * 40)

    # positions keyed by topic, then queue; a topic not named starts at its earliest
    rows = reader(spark, broker_addr, None, topics="mt.eu,mt.us",
                  startingOffsets=json.dumps({"mt.eu": {"0": 10, "1": -1}})).collect()
    want = {k for k in eu if k[0] == 0 and k[1] >= 10}
    assert {(r["queue"], r["offset"]) for r in rows if r["topic"] == "mt.eu"} == want
    assert len([r for r in rows if r["topic"] == "mt.us"]) == 40


def test_stream_over_a_pattern_reads_a_topic_created_later(spark, broker_addr, tmp_path):
    create_topic(broker_addr, "pat.a", 2)
    sent = {("pat.a", *k): v for k, v in produce(broker_addr, "pat.a", 25).items()}
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    opts = {"topicPattern": r"pat\..*", "startingOffsets": "earliest", "group": "spark-pat"}
    assert sum(_run_available_now(spark, broker_addr, None, out, ckpt, **opts)) == 25

    create_topic(broker_addr, "pat.b", 2)
    sent.update({("pat.b", *k): v for k, v in produce(broker_addr, "pat.b", 15).items()})
    sent.update({("pat.a", *k): v for k, v in produce(broker_addr, "pat.a", 5, start=25).items()})
    assert sum(_run_available_now(spark, broker_addr, None, out, ckpt, **opts)) == 20
    table = pq.read_table(str(out)).to_pylist()
    got = {(r["topic"], *k): v for r in table for k, v in as_sent([r]).items()}
    assert got == sent  # each once, both topics

    async def status():
        async with Admin(broker_addr) as a:
            return await a.group_status("spark-pat")
    st = asyncio.run(status())
    assert {q.topic for q in st.queues} == {"pat.a", "pat.b"} and st.lag == 0


def test_json_bodies_decoded_into_columns(spark, broker_addr):
    topic = "json_bodies"
    create_topic(broker_addr, topic, 1)
    bodies = [
        b'{"order_id":"o1","quantity":3,"event_time":"2026-01-01T00:00:01.500Z","x":1}',
        b'{\n  "order_id": "o2",\n  "quantity": 4\n}',  # pretty-printed
        b"not json",
        b'{"order_id":"o4","quantity":"many"}',  # a value of the wrong type
        b"[1, 2]",
        b"",
    ]
    with SyncProducer(broker_addr) as p:
        for b in bodies:
            p.send(topic, Message(b))
    schema = "order_id STRING, quantity INT, event_time TIMESTAMP"
    df = reader(spark, broker_addr, topic, bodyFormat="json", bodySchema=schema)
    assert df.columns[:1] == ["body"] and df.columns[-3:] == ["order_id", "quantity",
                                                              "event_time"]
    rows = sorted(df.collect(), key=lambda r: r["offset"])
    assert [bytes(r["body"]) for r in rows] == bodies
    decoded = [(r["order_id"], r["quantity"]) for r in rows]
    assert decoded == [("o1", 3), ("o2", 4), (None, None), (None, None), (None, None),
                       (None, None)]
    t = rows[0]["event_time"].astimezone(UTC)
    assert t == datetime(2026, 1, 1, 0, 0, 1, 500000, tzinfo=UTC)

    # instead of the body; Spark can filter on the decoded columns
    df = reader(spark, broker_addr, topic, bodyFormat="json", bodySchema=schema,
                includeBody="false")
    assert "body" not in df.columns
    assert [r["order_id"] for r in df.where("quantity > 3").collect()] == ["o2"]

    with pytest.raises(Exception, match="already: \\['topic'\\]"):
        reader(spark, broker_addr, topic, bodyFormat="json",
               bodySchema="topic STRING").collect()
