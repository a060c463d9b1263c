"""The Cluster page: a standalone broker says it is not in a cluster; two broker groups
of one broker each show their leaders, members, load and the placement of a spread
topic's queues, a moving queue marked when the console has the cluster's etcd."""

from __future__ import annotations

import asyncio
import json

import pytest

from onceq import Admin, Message, Producer, PullConsumer
from onceq.cluster import EtcdClient, read_route, replace_route
from onceq.console import ConsoleConfig
from onceq.console.cluster import GroupFacts, build_view
from tests.cluster.group import leader_of, make_group
from tests.console.world import console_client, text_of


def _st(log_end: int, messages: int, consumed: int, cluster: dict) -> dict:
    return {"log_start": 0, "log_end": log_end, "cluster": cluster,
            "counts": {"messages": messages, "consumed": consumed}}


def test_the_view_colours_groups_marks_moves_and_takes_rates_between_views() -> None:
    lead = {"broker_id": "1", "role": "leader", "epoch": 4, "hw": 900, "log_end": 1000,
            "isr": ["1"], "published_isr": ["1", "2"], "lag": {"2": 100}}
    facts = {"g1": GroupFacts("g1", "a:1", ["a:1", "a:2"]),
             "g2": GroupFacts("g2", "b:1", ["b:1"])}
    placement = {"orders": ["g1", "g2", "g1", "g2"], "one": ["g2"]}
    moving = {"orders": [(2, "g2", "handover")]}
    reads = {"a:1": (20.0, _st(3000, 30, 12, lead)),
             "a:2": (20.0, _st(2900, 30, 12, {"broker_id": "2", "role": "follower",
                                               "log_end": 2900})),
             "b:1": (20.0, None)}
    before = {"a:1": (18.0, _st(1000, 10, 2, lead))}
    view = build_view("g1", facts, placement, moving, reads, before)
    g1, g2 = view["groups"]
    assert g1["here"] and not g2["here"] and g1["colour"] != g2["colour"]
    assert (g1["leader"], g1["epoch"], g1["published_isr"]) == ("1", 4, ["1", "2"])
    assert g1["load"] == {"queues": 2, "queues_by_topic": {"orders": 2}, "moving_out": 1,
                          "moving_in": 0, "bytes": 3000, "write_bytes_s": 1000.0,
                          "write_msgs_s": 10.0, "consume_msgs_s": 5.0, "sampled_s": 2.0}
    assert g2["load"]["queues"] == 3 and g2["load"]["moving_in"] == 1
    assert g2["load"]["bytes"] is None  # its leader out of reach
    assert [(m["broker_id"], m["lag"], m["in_sync"]) for m in g1["members"]] == \
        [("1", 0, True), ("2", 100, False)]
    assert g2["members"][0]["role"] == "unreachable"
    cells = view["placement"][1]["queues"]  # "orders", after "one"
    assert [c["group"] for c in cells] == ["g1", "g2", "g1", "g2"]
    assert cells[2]["moving"] == ("g2", "handover") and cells[0]["moving"] is None
    assert view["width"] == 4 and view["sampled_s"] == 2.0
    assert view["moving"] == [{"topic": "orders", "queue": 2, "from": "g1", "to": "g2",
                               "phase": "handover"}]


async def test_a_standalone_broker_is_not_in_a_cluster(addr: str) -> None:
    async with console_client(ConsoleConfig(broker=addr)) as web:
        r = await web.get("/cluster")
        assert r.status_code == 200
        assert 'href="/cluster" class="on"' in r.text  # the nav link
        assert "is not in a cluster" in text_of(r.text)
        assert 'data-live="/live/cluster"' in r.text
        live = await web.get("/live/cluster")
        assert live.status_code == 200 and "not in a cluster" in text_of(live.text)
        assert "<html" not in live.text
        home = await web.get("/")
        assert 'href="/cluster"' in home.text


@pytest.mark.timeout(90)
async def test_two_groups_their_load_and_a_moving_queue(tmp_path, etcd_endpoint,
                                                        cluster_name) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes = [n for ns in groups.values() for n in ns]
    try:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        bootstrap = ",".join(n.address for n in nodes)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("orders", 4)
        g1 = groups["g1"][0].address
        async with console_client(ConsoleConfig(broker=g1)) as web:
            first = await web.get("/cluster")
            assert first.status_code == 200, first.text
            t = text_of(first.text)
            assert "in group g1" in t and "Rates appear at the next refresh" in t
            assert 'id="group-g1"' in first.text and 'id="group-g2"' in first.text
            assert 'id="placement"' in first.text and 'title="queue 1 on g2"' in first.text
            assert "not in a cluster" not in t
            async with Producer(bootstrap, send_timeout=10.0) as p:
                for i in range(40):
                    await p.send("orders", Message(json.dumps({"i": i}).encode()))
            async with PullConsumer(bootstrap, "billing") as c:
                for q in range(4):
                    r = await c.pull("orders", q, 0, 64)
                    await c.commit_offset("orders", q, r.next_offset)
            await asyncio.sleep(0.2)
            live = await web.get("/live/cluster")  # a second view: rates
            assert live.status_code == 200
            lt = text_of(live.text)
            assert "Rates over the last" in lt and "/s" in lt
            assert "leader" in lt and "yes" in lt  # members: role, in sync
        # queue 0 sealed on its way to g2: marked with the cluster's etcd
        client = EtcdClient(etcd_endpoint)
        route = await read_route(client, cluster_name, "orders")
        assert route is not None
        assert await replace_route(client, cluster_name, route,
                                   route.with_move(0, "g2", "sealed"))
        config = ConsoleConfig(broker=g1, cluster=f"etcd://{etcd_endpoint}",
                               cluster_name=cluster_name)
        async with console_client(config) as web:
            r = await web.get("/cluster")
            assert r.status_code == 200
            assert 'class="q moving"' in r.text and 'id="moving"' in r.text
            assert "moving to g2 (sealed)" in r.text
    finally:
        for n in nodes:
            n.kill()
