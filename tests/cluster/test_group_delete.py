"""``onceq group delete`` in a broker group: the deletion is a record of the replicated
log, so the group's next leader has forgotten the group's offsets too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from onceq.client.admin import Admin
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
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
