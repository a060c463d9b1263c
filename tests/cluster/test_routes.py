"""A topic spread over two broker groups (docs/cluster.md, "Topics over several groups"):
its queues placed evenly over the groups, each group storing and serving only its own
(``WRONG_GROUP`` for the others'), any broker answering the route, and clients given the
cluster's bootstrap list sending to and reading from each queue's group: every message
stored once, on its queue's group, in order per key."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from onceq.cli.cluster_cmd import cluster_view
from onceq.client.admin import Admin
from onceq.client.connection import BrokerConnection, call
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.replies import RouteInfo
from onceq.protocol.requests import GetRoute, Pull
from tests.cluster.group import Node, leader_of, make_group
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(90)
QUEUES = 4


async def _route(address: str, topic: str) -> RouteInfo:
    conn = await BrokerConnection.open(address)
    try:
        return await call(conn, GetRoute(topic), 5.0)
    finally:
        conn.close()


async def _read(c: PullConsumer, queue: int) -> list[str]:
    out, offset = [], 0
    while (r := await c.pull("orders", queue, offset, 256)).status == PullStatus.FOUND:
        out += [m.body.decode() for m in r.messages]
        offset = r.next_offset
    return out


def test_a_topic_over_two_groups(tmp_path: Path, etcd_endpoint: str,
                                 cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes: list[Node] = [n for ns in groups.values() for n in ns]

    async def go() -> None:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        bootstrap = ",".join(n.address for n in nodes)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("orders", QUEUES)
        placement = ["g1", "g2", "g1", "g2"]  # an even spread, in group name order
        for n in nodes:  # any broker answers the route; g2's leader creates the topic
            async def routed(n: Node = n) -> bool:
                r = await _route(n.address, "orders")
                return r.placement == placement and set(r.groups) == {"g1", "g2"}
            await wait_until(routed, 10, f"the route on broker {n.address}")
        sent: list[str] = []
        async with Producer(bootstrap, send_timeout=10.0) as p:
            for i in range(200):
                await p.send("orders", Message(f"u{i}".encode()))
                sent.append(f"u{i}")
            for i in range(100):
                key = f"k{i % 10}"
                r = await p.send("orders", Message(f"{key}-{i}".encode()), sharding_key=key)
                assert r.queue_id == zlib.crc32(key.encode()) % QUEUES
                sent.append(f"{key}-{i}")
            assert p.links.fetched >= 1
        # each group stores and serves its own queues only
        g1 = groups["g1"][0].address
        conn = await BrokerConnection.open(g1)
        try:
            with pytest.raises(OnceqError) as wrong:
                await call(conn, Pull("orders", 1, 0, 10), 5.0)
        finally:
            conn.close()
        assert wrong.value.code == ErrorCode.WRONG_GROUP and wrong.value.retriable
        assert wrong.value.details["group"] == "g2"
        # a client given one broker of the cluster follows the route after WRONG_GROUP
        async with PullConsumer(g1, "direct") as direct:
            assert len(await _read(direct, 0)) > 0
            assert not direct.links.enabled
            assert len(await _read(direct, 1)) > 0
            assert direct.links.enabled and direct.links.home == "g1"
        async with PullConsumer(bootstrap, "all") as c:
            assert await c.queue_count("orders") == QUEUES
            stored = {q: await _read(c, q) for q in range(QUEUES)}
        bodies = [b for q in stored for b in stored[q]]
        assert sorted(bodies) == sorted(sent)  # every message once
        assert all(len(stored[q]) > 0 for q in range(QUEUES))
        for k in range(10):  # in send order per key
            mine = [b for q in stored for b in stored[q] if b.startswith(f"k{k}-")]
            assert mine == [b for b in sent if b.startswith(f"k{k}-")]
        async with Admin(bootstrap) as admin:  # deleting a spread topic: refused
            with pytest.raises(OnceqError) as refused:
                await admin.delete_topic("orders")
            assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        # a group asked about a topic created on another group a moment ago (before its
        # next read of the routes) reads the route first: the topic gets the route's
        # queue count there, not default_queues as creating it on first use would
        g2 = groups["g2"][0].address
        async with Admin(g1) as on_g1, Admin(g2) as on_g2:
            await on_g1.create_topic("t16", 16)
            assert await on_g2.queue_count("t16") == 16
        view = await cluster_view(etcd_endpoint, cluster_name)
        assert view["routes"]["orders"]["by_group"] == {"g1": [0, 2], "g2": [1, 3]}
        assert view["routes"]["t16"]["queues"] == 16

    try:
        asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()
