"""The Spark source and sink against a replicated broker group, given its bootstrap list
(``"b1,b2,b3"``): a stream from one topic to another through the group, the leader
SIGKILLed between two runs and the last batch replayed after the dedup window (so only the
sink's writer sequences, reloaded by the new leader from the replicated log, can answer
it): every row stored once, read back by the source from the new leader."""

from __future__ import annotations

import asyncio

import pytest

from onceq.client.sync import SyncProducer
from tests.cluster.group import leader_of, make_group

from .conftest import create_topic
from .test_sink import _stream, read_all

pytestmark = pytest.mark.timeout(300)


def test_stream_through_a_group_across_a_leader_kill(spark, tmp_path, etcd_endpoint,
                                                     cluster_name):
    nodes = make_group(tmp_path, etcd_endpoint, cluster_name, 3, "--dedup-window", "0.5")
    try:
        leader = asyncio.run(leader_of(nodes, isr=3))
        # a follower first: every client must find the leader from the bootstrap list
        servers = ",".join(n.address for n in sorted(nodes, key=lambda n: n is leader))
        src, dst = "g_src", "g_dst"
        create_topic(servers, src, 2)
        create_topic(servers, dst, 2)
        with SyncProducer(servers) as p:
            for i in range(400):
                p.send(src, f"e{i}".encode(), queue=i % 2)
        ckpt = tmp_path / "ckpt"
        first = _stream(spark, servers, src, dst, ckpt)
        assert sum(first) == 400 and len([n for n in first if n]) == 2

        old = asyncio.run(leader_of(nodes, isr=3))
        old.kill()  # SIGKILL; electing a successor takes longer than the dedup window
        asyncio.run(leader_of([n for n in nodes if n is not old], timeout=20, isr=2))
        # forget that the last batch was committed: the next run replays it
        last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
        for name in (str(last), f".{last}.crc"):
            (ckpt / "commits" / name).unlink(missing_ok=True)
        replayed = _stream(spark, servers, src, dst, ckpt)
        assert sum(replayed) == first[-1] > 0

        rows = read_all(spark, servers, dst)
        bodies = sorted(bytes(r["body"]) for r in rows)
        assert bodies == sorted(f"e{i}".encode() for i in range(400))
        assert all(r["queue"] == int(bytes(r["body"])[1:]) % 2 for r in rows)
    finally:
        for n in nodes:
            n.kill()


def test_the_source_and_sink_across_two_groups(spark, tmp_path, etcd_endpoint,
                                               cluster_name):
    """A topic spread over two broker groups: the sink writes each row to its queue's
    group (writer sequences per (writer, queue) there), the source reads one partition per
    queue wherever it lives; a re-run of the same writer id stores nothing more."""
    from pyspark.sql import functions as F

    from .test_sink import write

    groups = [make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync", "1",
                         group=g) for g in ("g1", "g2")]
    nodes = [n for ns in groups for n in ns]
    try:
        for ns in groups:
            asyncio.run(leader_of(ns, timeout=20))
        servers = ",".join(n.address for n in nodes)
        create_topic(servers, "spread", 4)
        df = spark.range(0, 1000, 1, 4).select(  # one queue per partition: all four
            F.concat(F.lit("r"), F.col("id").cast("string")).alias("body"))
        write(df, servers, "spread", writerId="spread-job-1")
        write(df, servers, "spread", writerId="spread-job-1")  # a re-run: stored once
        rows = read_all(spark, servers, "spread")
        assert sorted(bytes(r["body"]) for r in rows) == sorted(
            f"r{i}".encode() for i in range(1000))
        assert {r["queue"] for r in rows} == {0, 1, 2, 3}
    finally:
        for n in nodes:
            n.kill()
