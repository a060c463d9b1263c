"""Push consumers of a topic spread over two broker groups (docs/cluster.md, "Consumer
groups across broker groups"): each consumer is a member of the consumer group on both
broker groups, each broker group's queues are allocated among its members under its own
access lock, and every message is consumed once, members joining and leaving."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from onceq.client.admin import Admin
from onceq.client.allocation import MessageQueue
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.push import PushConsumer
from tests.cluster.group import Node, leader_of, make_group
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)
TOPIC = "orders"
QUEUES = 8


class Seen:
    """What the listeners consumed, recorded inside them (asserted outside)."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.by: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def listener(self, name: str) -> Any:
        def consume(msgs: list[Any], ctx: Any) -> None:
            with self._lock:
                for m in msgs:
                    self.count[m.body.decode()] += 1
                    self.by.setdefault(name, set()).add(m.body.decode())
        return consume


def _consumer(bootstrap: str, name: str, seen: Seen) -> PushConsumer:
    c = PushConsumer(bootstrap, "billing", seen.listener(name), client_id=name,
                     rebalance_interval_s=0.5, heartbeat_interval_s=0.5)
    c.subscribe(TOPIC)
    return c


def _spread_owned(cs: list[PushConsumer]) -> list[MessageQueue]:
    return sorted(q for c in cs for q in c.assignment if q.topic == TOPIC)


def test_push_consumers_over_two_broker_groups(tmp_path: Path, etcd_endpoint: str,
                                               cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes: list[Node] = [n for ns in groups.values() for n in ns]
    every = [MessageQueue(TOPIC, q) for q in range(QUEUES)]

    async def go() -> None:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        bootstrap = ",".join(n.address for n in nodes)
        async with Admin(bootstrap) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        seen = Seen()
        sent: list[str] = []

        async def send(n: int) -> None:
            async with Producer(bootstrap, send_timeout=10.0) as p:
                for _ in range(n):
                    body = f"m{len(sent)}"
                    await p.send(TOPIC, Message(body.encode()))
                    sent.append(body)

        # each consumer given the brokers of one group only: it joins the other by route
        a = await _consumer(groups["g1"][0].address, "a", seen).start()
        b = await _consumer(groups["g2"][0].address, "b", seen).start()
        members = [a, b]
        try:
            await wait_until(lambda: _spread_owned(members) == every, 20,
                             "a and b to own every queue once")
            assert {"g1", "g2"} == {a.links.home, *a.members} == {b.links.home, *b.members}
            assert a.assignment and b.assignment
            await send(200)
            await wait_until(lambda: len(seen.count) == len(sent), 20, "the first 200")
            c = await _consumer(bootstrap, "c", seen).start()  # joins
            members.append(c)
            await wait_until(lambda: _spread_owned(members) == every
                             and all(m.assignment for m in members), 20, "c to own queues")
            await send(200)
            await a.shutdown()  # leaves
            members.remove(a)
            await wait_until(lambda: _spread_owned(members) == every, 20,
                             "b and c to take a's queues")
            await send(200)
            await wait_until(lambda: len(seen.count) == len(sent), 20, "all 600")
        finally:
            for m in members:
                await m.shutdown()
        assert sorted(seen.count) == sorted(sent)
        assert set(seen.count.values()) == {1}, "a message consumed twice"
        assert seen.by.get("c"), "the member that joined consumed nothing"

    try:
        asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()
