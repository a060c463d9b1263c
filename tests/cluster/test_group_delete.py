"""``onceq group delete`` in a cluster: the deletion is a record of the replicated log, so a
broker group's next leader has forgotten the consumer group's offsets too; ``--cluster``
deletes it on every broker group."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from onceq.client.admin import Admin
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.push import PushConsumer
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.cluster.group import leader_of, make_group

pytestmark = pytest.mark.timeout(90)


def test_a_deleted_group_stays_deleted_after_a_failover(tmp_path: Path, etcd_endpoint: str,
                                                        cluster_name: str) -> None:
    nodes = make_group(tmp_path, etcd_endpoint, cluster_name, 3)
    bootstrap = ",".join(n.address for n in nodes)

    async def go() -> tuple[int, list[str], list[str], ErrorCode]:
        leader = await leader_of(nodes, timeout=20, isr=3)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("T", 2)
        async with Producer(bootstrap) as p:
            for q in (0, 1):
                await p.send_batch("T", [b"a", b"b", b"c"], queue=q)
        for group in ("billing", "audit"):
            async with PullConsumer(bootstrap, group) as c:
                await c.commit_offset("T", 0, 2)
                await c.commit_offset("T", 1, 3)
        async with Admin(bootstrap) as admin:
            forgotten = await admin.delete_group("billing")
            before = await admin.list_groups()
        leader.kill()
        rest = [n for n in nodes if n is not leader]
        await leader_of(rest, timeout=20)
        async with Admin(",".join(n.address for n in rest)) as admin:
            after = await admin.list_groups()
            try:
                await admin.delete_group("billing")
                code = ErrorCode.OK
            except OnceqError as exc:
                code = exc.code
        return forgotten, before, after, code

    try:
        forgotten, before, after, code = asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()
    assert forgotten == 2
    assert before == after == ["audit"]
    assert code == ErrorCode.GROUP_NOT_EXIST


def test_a_group_is_deleted_on_every_broker_group_of_a_cluster(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    """``onceq group delete --cluster``: a consumer group of a topic spread over two broker
    groups has offsets on each; a live member on either refuses it, then it goes from both."""
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes = [n for ns in groups.values() for n in ns]
    bootstrap = ",".join(n.address for n in nodes)
    cli = [sys.executable, "-m", "onceq.cli.main", "group", "delete", "billing", "--json",
           "--cluster", f"etcd://{etcd_endpoint}", "--cluster-name", cluster_name]

    def delete() -> subprocess.CompletedProcess[str]:
        return subprocess.run(cli, capture_output=True, text=True, timeout=60)

    async def go() -> dict[str, object]:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        async with Admin(bootstrap) as admin:
            await admin.create_topic("T", 4)  # queues 0, 2 on g1 and 1, 3 on g2
        async with Producer(bootstrap) as p:
            for q in range(4):
                await p.send_batch("T", [b"a", b"b"], queue=q)
        async with PullConsumer(bootstrap, "billing") as c:
            for q in range(4):
                await c.commit_offset("T", q, 1)
        member = PushConsumer(groups["g2"][0].address, "billing", lambda m, c: None,
                              consume_from="FIRST")
        member.subscribe("T")
        await member.start()
        try:
            refused = await asyncio.to_thread(delete)
        finally:
            await member.shutdown()
        deleted = await asyncio.to_thread(delete)
        again = await asyncio.to_thread(delete)
        left = {}
        for g, ns in groups.items():
            async with Admin(ns[0].address) as admin:
                left[g] = await admin.list_groups()
        return {"refused": refused, "deleted": deleted, "again": again, "left": left}

    try:
        out = asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()
    refused, deleted, again = out["refused"], out["deleted"], out["again"]
    assert refused.returncode == 2 and refused.stderr.startswith("error: GROUP_ACTIVE:"), (
        refused.stdout, refused.stderr)
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(deleted.stdout) == {"group": "billing", "deleted": True, "queues": 4,
                                          "broker_groups": {"g1": 2, "g2": 2}}
    assert again.returncode == 2 and again.stderr.startswith("error: GROUP_NOT_EXIST:")
    assert out["left"] == {"g1": [], "g2": []}
