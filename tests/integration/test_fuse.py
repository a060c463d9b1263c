"""The queue-depth fuse against a real broker (``fuse_depth``): a slow consumer group and
a fast producer. The backlog stays within the fuse, unkeyed sends move to the queues
that still take them, a keyed send to a full queue fails ``QUEUE_FULL`` cleanly (never
moved to another queue), and once the group catches up everything was stored once, in
order per key."""

from __future__ import annotations

import importlib.util

import pytest

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import running_broker
from tests.integration.test_metrics import ascrape, get

pytestmark = pytest.mark.timeout(60)
LIMIT, QUEUES = 20, 4


async def _backlogs(c: PullConsumer) -> list[int]:
    out = []
    for q in range(QUEUES):
        _, end = await c.queue_offsets("orders", q)
        out.append(end - (await c.fetch_offset("orders", q) or 0))
    return out


async def _read_all(c: PullConsumer) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for q in range(QUEUES):
        offset = 0
        while True:
            r = await c.pull("orders", q, offset, 256)
            if r.status != PullStatus.FOUND:
                break
            out.setdefault(q, []).extend(m.body.decode() for m in r.messages)
            offset = r.next_offset
    return out


async def test_a_slow_group_holds_the_backlog_at_the_fuse(tmp_path) -> None:
    async with running_broker(str(tmp_path / "data"), fuse_depth=LIMIT, metrics_port=0) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin, PullConsumer(addr, "slow") as slow, \
                Producer(addr, send_timeout=0.5) as p:
            await admin.create_topic("orders", QUEUES)
            for q in range(QUEUES):  # the slow group has consumed nothing yet
                await slow.commit_offset("orders", q, 0)
            sent: list[str] = []
            with pytest.raises(OnceqError) as full:  # unkeyed, until every queue is full
                for i in range(10 * LIMIT * QUEUES):
                    await p.send("orders", Message(f"u{i}".encode(), unique_key=f"u{i}"))
                    sent.append(f"u{i}")
            assert full.value.code == ErrorCode.QUEUE_FULL and full.value.retriable
            assert len(sent) == LIMIT * QUEUES  # each queue took exactly its fuse
            assert await _backlogs(slow) == [LIMIT] * QUEUES

            # the group catches up on queue 2 only: unkeyed sends all go there now
            await slow.commit_offset("orders", 2, LIMIT)
            for i in range(LIMIT):
                r = await p.send("orders", Message(f"v{i}".encode(), unique_key=f"v{i}"))
                assert r.queue_id == 2
                sent.append(f"v{i}")
            assert p.health.avoided > 0

            # a key whose queue is full: refused after the send timeout, never moved
            key = next(k for k in (f"k{i}" for i in range(100))
                       if p._pick_queue("orders", QUEUES, k, None) == 1)
            with pytest.raises(OnceqError) as keyed:
                await p.send("orders", Message(b"k-first", unique_key="k-first"),
                             sharding_key=key)
            assert keyed.value.code == ErrorCode.QUEUE_FULL
            assert await _backlogs(slow) == [LIMIT] * QUEUES
            await slow.commit_offset("orders", 1, LIMIT)  # its queue drains: taken now
            for body in ("k1", "k2", "k3"):
                r = await p.send("orders", Message(body.encode(), unique_key=body),
                                 sharding_key=key)
                assert r.queue_id == 1
                sent.append(body)

            # the operator's view: the group's status names the tripped queues
            status = await admin.group_status("slow")
            fuses = {q.queue_id: (q.fuse_limit, q.fuse_tripped) for q in status.queues}
            assert fuses[0] == (LIMIT, True) and fuses[1][1] is False
            assert (await admin.broker_status())["fuse"]["limit"] == LIMIT
            metrics = await ascrape(f"http://127.0.0.1:{b.metrics.port}/metrics")
            assert get(metrics, "onceq_sends_refused_queue_full_total") == b.sends.fuse.refused
            assert get(metrics, "onceq_queue_fuses_tripped") == len(b.sends.fuse.tripped) > 0

            if importlib.util.find_spec("starlette") is not None:  # the console extra
                from tests.console.world import ConsoleConfig, console_client, text_of
                async with console_client(ConsoleConfig(broker=addr)) as web:
                    page = text_of((await web.get("/groups/slow/lag")).text)
                assert f"TRIPPED (at {LIMIT})" in page

            stored = await _read_all(slow)
            bodies = [b for q in sorted(stored) for b in stored[q]]
            assert sorted(bodies) == sorted(sent)  # nothing lost, nothing stored twice
            assert "k-first" not in bodies  # a refused send is not stored
            assert [b for b in stored[1] if b.startswith("k")] == ["k1", "k2", "k3"]
            assert b.sends.fuse is not None and b.sends.fuse.refused > 0
