"""``onceq cluster status`` on two broker groups of one broker each (docs/cluster.md,
"Operator view"): per group the queues it holds, its leader's stored bytes, its write
and consume rates measured over ``--sample-s``, and a queue marked while it moves."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from onceq.cli.cluster_cmd import cluster_view
from onceq.cli.main import main
from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.cluster import EtcdClient, read_route, replace_route
from tests.cluster.group import Node, leader_of, make_group

pytestmark = pytest.mark.timeout(90)
QUEUES = 4


async def _send_for(bootstrap: str, seconds: float) -> int:
    sent = 0
    async with Producer(bootstrap, send_timeout=10.0) as p:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await p.send("orders", Message(b"x" * 200))
            sent += 1
            await asyncio.sleep(0.005)
    return sent


async def _consume(bootstrap: str) -> None:
    """Commit every queue to its end, again and again (a consumer group that keeps up)."""
    async with PullConsumer(bootstrap, "billing") as c:
        offsets = [0] * QUEUES
        while True:
            for q in range(QUEUES):
                r = await c.pull("orders", q, offsets[q], 256)
                if r.messages:
                    offsets[q] = r.next_offset
                    await c.commit_offset("orders", q, offsets[q])
            await asyncio.sleep(0.05)


def test_status_shows_each_groups_load_and_a_moving_queue(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes: list[Node] = [n for ns in groups.values() for n in ns]
    bootstrap = ",".join(n.address for n in nodes)

    async def go() -> None:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("orders", QUEUES)
        idle = await cluster_view(etcd_endpoint, cluster_name)  # no sampling: no rate
        assert [g["group"] for g in idle["groups"]] == ["g1", "g2"]
        for g in idle["groups"]:
            assert g["load"]["queues"] == 2 and g["load"]["queues_by_topic"] == {"orders": 2}
            assert g["load"]["write_bytes_s"] is None and g["load"]["bytes"] >= 0
            assert g["members"][0]["role"] == "leader"  # the keys of before are kept
        assert idle["routes"]["orders"]["by_group"] == {"g1": [0, 2], "g2": [1, 3]}
        assert idle["routes"]["orders"]["moving"] == [] and idle["moving"] == []
        consumer = asyncio.create_task(_consume(bootstrap))
        sender = asyncio.create_task(_send_for(bootstrap, 4.0))
        try:
            await asyncio.sleep(1.0)
            view = await cluster_view(etcd_endpoint, cluster_name, sample_s=1.5)
        finally:
            sent = await sender
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
        assert sent > 20
        for g in view["groups"]:
            load = g["load"]
            assert 1.4 <= load["sampled_s"] <= 3.0, load
            assert load["bytes"] > 0 and load["write_bytes_s"] > 0, (g["group"], load)
            assert load["write_msgs_s"] > 0 and load["consume_msgs_s"] is not None, load
        assert sum(g["load"]["consume_msgs_s"] for g in view["groups"]) > 0
        # a queue being moved is shown: queue 0 sealed on its way to g2
        client = EtcdClient(etcd_endpoint)
        route = await read_route(client, cluster_name, "orders")
        assert route is not None
        assert await replace_route(client, cluster_name, route,
                                   route.with_move(0, "g2", "sealed"))

    try:
        asyncio.run(go())
        result = CliRunner().invoke(main, ["cluster", "status", "--cluster",
                                           f"etcd://{etcd_endpoint}", "--cluster-name",
                                           cluster_name, "--json", "--sample-s", "0.2"])
        assert result.exit_code == 0, result.output
        view = json.loads(result.output)
        assert view["moving"] == [{"topic": "orders", "queue": 0, "from": "g1", "to": "g2",
                                   "phase": "sealed"}]
        assert [(g["group"], g["load"]["moving_out"], g["load"]["moving_in"])
                for g in view["groups"]] == [("g1", 1, 0), ("g2", 0, 1)]
        assert view["sample_s"] == 0.2 and "members" in view["groups"][0]
        text = CliRunner().invoke(main, ["cluster", "status", "--cluster",
                                         f"etcd://{etcd_endpoint}", "--cluster-name",
                                         cluster_name, "--sample-s", "0"])
        assert text.exit_code == 0, text.output
        assert "load per group" in text.output and "queues moving" in text.output
        assert "sealed" in text.output
    finally:
        for n in nodes:
            n.kill()
