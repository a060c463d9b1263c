"""Clients given the group's bootstrap list talk to its leader: a producer, a pull
consumer and an admin client redirected by NOT_LEADER, and after the leader is killed,
moved to the new one within their timeouts, where a retried acknowledged send is a
duplicate."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from onceq.cli.main import main
from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.route import BrokerRoute, split_addresses
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.cluster.group import Node, leader_of

pytestmark = pytest.mark.timeout(60)


def test_route_rules() -> None:
    assert split_addresses(" a:1, b:2,a:1 ") == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        split_addresses("a:1,b")
    r = BrokerRoute("a:1")
    assert not r.group and r.current == "a:1"
    r = BrokerRoute("a:1,b:2")
    assert r.group
    assert r.redirect(OnceqError(ErrorCode.NOT_LEADER, "x", {"leader": "c:3"}))
    assert r.current == "c:3" and r.addresses == ["a:1", "b:2", "c:3"]
    assert not r.redirect(OnceqError(ErrorCode.NOT_LEADER, "no leader yet"))
    assert not r.redirect(OnceqError(ErrorCode.NOT_ENOUGH_REPLICAS, "x", {"leader": "a:1"}))

    async def ask(address: str) -> dict | None:
        return {"a:1": None, "b:2": {"role": "follower", "leader": "a:1"}}.get(address)

    assert asyncio.run(r.find_leader(ask)) == "a:1"


def test_clients_follow_the_leader(group: list[Node]) -> None:
    async def go() -> None:
        leader = await leader_of(group, isr=3)
        followers = [n for n in group if n is not leader]
        # a follower first in the list: the clients are redirected to the leader
        bootstrap = ",".join(n.address for n in [*followers, leader])
        async with Producer(bootstrap, send_timeout=15.0) as p, \
                PullConsumer(bootstrap, "g") as c, Admin(bootstrap) as a:
            await a.create_topic("t", 1)
            acked = [await p.send("t", Message(f"m{i}".encode(), unique_key=f"k{i}"))
                     for i in range(5)]
            assert p.address == leader.address
            assert [r.offset for r in acked] == list(range(5))
            leader.kill()
            # the producer finds the new leader within its send timeout
            r = await p.send("t", Message(b"m5", unique_key="k5"))
            assert r.offset == 5 and not r.duplicate
            new = await leader_of(followers, timeout=5)
            assert p.address == new.address
            # a retry of an acknowledged send: the new leader's answer is a duplicate
            again = await p.send("t", Message(b"m3", unique_key="k3"))
            assert again.duplicate and again.offset == 3
            got = await c.pull("t", 0, 0, 64)
            assert got.status == PullStatus.FOUND
            assert [m.body for m in got.messages] == [f"m{i}".encode() for i in range(6)]
            assert c.address == new.address
            assert (await a.queue_offsets("t", 0))[1] == 6

    asyncio.run(go())


def test_cluster_status_command(group: list[Node], etcd_endpoint: str,
                                cluster_name: str) -> None:
    leader = asyncio.run(leader_of(group, isr=3))
    res = CliRunner().invoke(main, ["cluster", "status", "--cluster",
                                    f"etcd://{etcd_endpoint}", "--cluster-name",
                                    cluster_name, "--json"])
    assert res.exit_code == 0, res.output
    view = json.loads(res.output)
    assert view["etcd"]["healthy"]
    [g] = view["groups"]
    assert g["leader"] == leader.broker_id and g["epoch"] >= 1
    assert sorted(g["published_isr"]) == ["1", "2", "3"]
    assert [m["broker_id"] for m in g["members"]] == ["1", "2", "3"]
    assert all(m["in_sync"] and m["lag"] == 0 for m in g["members"])
    roles = sorted(m["role"] for m in g["members"])
    assert roles == ["follower", "follower", "leader"]
    text = CliRunner().invoke(main, ["cluster", "status", "--cluster",
                                     f"etcd://{etcd_endpoint}", "--cluster-name",
                                     cluster_name])
    assert f"group g1: leader {leader.broker_id}" in text.output
