"""The broker over loopback: topics, send, pull, long polling, offsets, groups, flush, dedup,
restart and the blocking clients."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
import time
from typing import Any

import pytest

from onceq import (
    Admin,
    Broker,
    BrokerConfig,
    ErrorCode,
    Message,
    OnceqError,
    Producer,
    PullConsumer,
    PullStatus,
    SyncProducer,
    SyncPullConsumer,
)
from onceq.client.connection import BrokerConnection
from onceq.protocol.codes import PushCode, RequestCode
from tests.helpers import running_broker, small_store, spawn_broker


async def _topic(addr: str, name: str = "T", queues: int = 4) -> None:
    async with Admin(addr) as admin:
        await admin.create_topic(name, queues)


async def _read_queue(addr: str, topic: str, queue: int, offset: int = 0) -> list[Any]:
    out = []
    async with PullConsumer(addr, "reader") as c:
        while True:
            r = await c.pull(topic, queue, offset, 256)
            if r.status != PullStatus.FOUND:
                return out
            out.extend(r.messages)
            offset = r.next_offset


# ================================================================ topics
async def test_topic_create_list_get_grow_delete(addr):
    async with Admin(addr) as admin:
        assert await admin.list_topics() == []
        t = await admin.create_topic("orders", 3)
        assert t == {"topic": "orders", "queues": 3}
        await admin.create_topic("audit", 1)
        assert await admin.list_topics() == [{"topic": "audit", "queues": 1},
                                             {"topic": "orders", "queues": 3}]
        assert len(await admin.topic_offsets("orders")) == 3
        # grow: more queues, existing queues and data are kept
        async with Producer(addr) as p:
            r = await p.send("orders", b"before grow", queue=2)
        assert (await admin.create_topic("orders", 6))["queues"] == 6
        assert await admin.topic_offsets("orders") == [(0, 0), (0, 0), (0, 1), (0, 0),
                                                       (0, 0), (0, 0)]
        assert (await _read_queue(addr, "orders", 2))[0].unique_key == r.unique_key
        # shrinking is refused, exclusive create of an existing topic is refused
        with pytest.raises(OnceqError) as ei:
            await admin.create_topic("orders", 2)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT
        with pytest.raises(OnceqError) as ei:
            await admin.create_topic("orders", 6, exclusive=True)
        assert ei.value.code == ErrorCode.TOPIC_EXISTS
        await admin.delete_topic("orders")
        assert await admin.list_topics() == [{"topic": "audit", "queues": 1}]
        with pytest.raises(OnceqError) as ei:
            await admin.delete_topic("orders")
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        with pytest.raises(OnceqError) as ei:
            await admin.topic_offsets("orders")
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        # re-created under the same name: empty, the old messages are gone
        await admin.create_topic("orders", 2)
        assert await admin.topic_offsets("orders") == [(0, 0), (0, 0)]


async def test_send_to_unknown_topic_is_refused_without_auto_create(broker, addr):
    async with Producer(addr, send_timeout=1.0) as p:
        with pytest.raises(OnceqError) as ei:
            await p.send("nope", b"x")
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        with pytest.raises(OnceqError) as ei:
            await p.send("nope", b"x", queue=0)
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
    assert "nope" not in broker.store.topics
    async with Admin(addr) as admin:
        assert await admin.list_topics() == []


async def test_auto_create_topics_when_enabled(tmp_path):
    async with running_broker(str(tmp_path), auto_create_topics=True, default_queues=3) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Producer(addr) as p:
            r = await p.send("auto", b"x")
        async with Admin(addr) as admin:
            assert await admin.list_topics() == [{"topic": "auto", "queues": 3}]
        assert [m.body for m in await _read_queue(addr, "auto", r.queue_id)] == [b"x"]
        # an invalid name is still refused
        async with Producer(addr, send_timeout=1.0) as p:
            with pytest.raises(OnceqError) as ei:
                await p.send("bad name", b"x")
            assert ei.value.code == ErrorCode.INVALID_NAME


# ================================================================ send
async def test_send_single_and_batch_offsets_are_consecutive(addr):
    await _topic(addr, "T", 1)
    async with Producer(addr) as p:
        r0 = await p.send("T", b"a")
        rs = await p.send_batch("T", [b"b", "c", Message(b"d")])
        r4 = await p.send("T", b"e")
    assert (r0.queue_id, r0.offset) == (0, 0)
    assert [(r.queue_id, r.offset) for r in rs] == [(0, 1), (0, 2), (0, 3)]
    assert r4.offset == 4
    keys = [r0.unique_key, *(r.unique_key for r in rs), r4.unique_key]
    assert len(set(keys)) == 5
    msgs = await _read_queue(addr, "T", 0)
    assert [m.body for m in msgs] == [b"a", b"b", b"c", b"d", b"e"]
    assert [m.unique_key for m in msgs] == keys
    assert [m.queue_offset for m in msgs] == [0, 1, 2, 3, 4]
    assert await Producer(addr).send_batch("T", []) == []


async def test_producer_refreshes_queue_count_after_topic_recreated(addr):
    await _topic(addr, "T", 4)
    async with Producer(addr) as p:
        assert [(await p.send("T", b"x")).queue_id for _ in range(2)] == [0, 1]
        async with Admin(addr) as admin:
            await admin.delete_topic("T")
            await admin.create_topic("T", 1)
        r = await p.send("T", b"y")  # queue 2 no longer exists: refreshed and retried
        assert (r.queue_id, r.offset) == (0, 0)
        assert await p.queue_count("T") == 1


async def test_round_robin_spreads_and_sharding_key_pins(addr):
    await _topic(addr, "T", 4)
    async with Producer(addr) as p:
        rr = [await p.send("T", f"m{i}") for i in range(8)]
        pinned = [await p.send("T", f"o{i}", sharding_key="order-42") for i in range(5)]
        other = await p.send("T", "x", sharding_key="order-43")
        explicit = await p.send("T", "y", queue=3)
    assert sorted(r.queue_id for r in rr) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({r.queue_id for r in pinned}) == 1
    q = pinned[0].queue_id
    assert [r.offset for r in pinned] == list(range(2, 7))
    assert 0 <= other.queue_id < 4
    assert explicit.queue_id == 3
    bodies = [m.body for m in await _read_queue(addr, "T", q)]
    assert [b for b in bodies if b.startswith(b"o")] == [f"o{i}".encode() for i in range(5)]


async def test_tags_keys_properties_round_trip(addr):
    await _topic(addr, "T", 1)
    props = {"trace": "abc", "unicode": "żółw ✓", "empty": ""}
    body = bytes(range(256)) * 10
    async with Producer(addr) as p:
        r = await p.send("T", Message(body, tags="TagA", keys="order-1 user-7",
                                      properties=props, unique_key="MY-UNIQUE-KEY-1"))
        r2 = await p.send("T", Message(b"", tags="", keys=""))
    assert r.unique_key == "MY-UNIQUE-KEY-1"
    m, m2 = await _read_queue(addr, "T", 0)
    assert m.body == body
    assert m.tags == "TagA"
    assert m.key_list == ["order-1", "user-7"]
    assert m.properties == props
    assert m.unique_key == "MY-UNIQUE-KEY-1"
    assert m.topic == "T" and m.queue_id == 0 and m.queue_offset == 0
    assert m.store_ts_ms >= m.born_ts_ms - 1000
    assert (m2.body, m2.tags, m2.key_list, m2.properties) == (b"", "", [], {})
    assert m2.unique_key == r2.unique_key


# ================================================================ pull
async def test_pull_statuses(addr):
    await _topic(addr, "T", 2)
    async with Producer(addr) as p:
        await p.send_batch("T", [b"1", b"2", b"3"], queue=0)
    async with PullConsumer(addr, "g") as c:
        r = await c.pull("T", 0, 0, 2)
        assert r.status == PullStatus.FOUND
        assert [m.body for m in r.messages] == [b"1", b"2"]
        assert (r.next_offset, r.min_offset, r.max_offset) == (2, 0, 3)
        r = await c.pull("T", 0, 2, 32)
        assert [m.body for m in r.messages] == [b"3"] and r.next_offset == 3
        r = await c.pull("T", 0, 3)
        assert r.status == PullStatus.NO_NEW_MESSAGE and r.messages == []
        assert r.next_offset == 3
        r = await c.pull("T", 0, 10)
        assert r.status == PullStatus.OFFSET_ILLEGAL and r.next_offset == 3
        r = await c.pull("T", 1, 0)
        assert r.status == PullStatus.NO_NEW_MESSAGE
        with pytest.raises(OnceqError) as ei:
            await c.pull("T", 2, 0)
        assert ei.value.code == ErrorCode.INVALID_QUEUE
        with pytest.raises(OnceqError) as ei:
            await c.pull("missing", 0, 0)
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST


async def test_pull_offset_moved_after_retention(tmp_path):
    store_kw = {"segment_size": 64 * 1024, "max_body": 8 * 1024, "retention_bytes": 64 * 1024}
    async with running_broker(str(tmp_path), store_kw) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        body = b"r" * 4000
        async with Producer(addr) as p:
            for _ in range(6):
                await p.send_batch("T", [body] * 10, queue=0)
        assert len(b.store.log.segments) >= 4
        await b._retention()
        assert len(b.store.log.segments) <= 2
        lo, hi = b.store.min_max("T", 0)
        assert lo > 0 and hi == 60
        async with PullConsumer(addr, "g") as c:
            r = await c.pull("T", 0, 0)
            assert r.status == PullStatus.OFFSET_MOVED
            assert r.messages == [] and r.next_offset == lo and r.min_offset == lo
            r = await c.pull("T", 0, r.next_offset, 100)
            assert r.status == PullStatus.FOUND
            assert [m.queue_offset for m in r.messages] == list(range(lo, 60))
            assert await c.queue_offsets("T", 0) == (lo, 60)


async def test_tag_filtering(addr):
    await _topic(addr, "T", 1)
    async with Producer(addr) as p:
        await p.send_batch("T", [Message(f"{t}{i}".encode(), tags=t)
                                 for i, t in enumerate("ABCABCA")] + [Message(b"none")])
    async with PullConsumer(addr, "g") as c:
        r = await c.pull("T", 0, 0, 100, tags="A || B")
        assert r.status == PullStatus.FOUND
        assert [m.body for m in r.messages] == [b"A0", b"B1", b"A3", b"B4", b"A6"]
        assert r.next_offset == 8
        r = await c.pull("T", 0, 0, 100, tags="C")
        assert [m.body for m in r.messages] == [b"C2", b"C5"]
        for expr in ("*", None, ""):
            r = await c.pull("T", 0, 0, 100, tags=expr)
            assert len(r.messages) == 8
        r = await c.pull("T", 0, 7, 100, tags="A || B")
        assert r.status == PullStatus.NO_NEW_MESSAGE and r.next_offset == 8


# ================================================================ long polling
async def test_long_poll_returns_when_a_message_arrives(addr):
    await _topic(addr, "T", 2)
    async with PullConsumer(addr, "g") as c, Producer(addr) as p:
        t0 = time.monotonic()
        pull = asyncio.create_task(c.pull("T", 1, 0, suspend=5))
        await asyncio.sleep(0.1)
        assert not pull.done()
        await p.send("T", b"other queue", queue=0)
        await asyncio.sleep(0.05)
        assert not pull.done()
        await p.send("T", b"wake", queue=1)
        r = await asyncio.wait_for(pull, 2)
        assert time.monotonic() - t0 < 1.0
        assert r.status == PullStatus.FOUND
        assert [m.body for m in r.messages] == [b"wake"]


async def test_long_poll_times_out_with_no_new_message(addr):
    await _topic(addr, "T", 1)
    async with PullConsumer(addr, "g") as c:
        t0 = time.monotonic()
        r = await c.pull("T", 0, 0, suspend=0.3)
        dt = time.monotonic() - t0
    assert r.status == PullStatus.NO_NEW_MESSAGE and r.next_offset == 0
    assert 0.25 <= dt < 1.0


async def test_long_poll_with_tags_ignores_unmatched_messages(addr):
    await _topic(addr, "T", 1)
    async with PullConsumer(addr, "g") as c, Producer(addr) as p:
        t0 = time.monotonic()
        pull = asyncio.create_task(c.pull("T", 0, 0, tags="A", suspend=5))
        await asyncio.sleep(0.05)
        await p.send("T", Message(b"b", tags="B"))
        await asyncio.sleep(0.05)
        assert not pull.done()
        await p.send("T", Message(b"a", tags="A"))
        r = await asyncio.wait_for(pull, 2)
        assert time.monotonic() - t0 < 1.0
        assert [m.body for m in r.messages] == [b"a"] and r.next_offset == 2


async def test_broker_caps_the_long_poll_hold(tmp_path):
    async with running_broker(str(tmp_path), long_poll_max_s=0.2) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        async with PullConsumer(addr, "g") as c:
            t0 = time.monotonic()
            r = await c.pull("T", 0, 0, suspend=10)
            dt = time.monotonic() - t0
        assert r.status == PullStatus.NO_NEW_MESSAGE
        assert 0.15 <= dt < 1.0


async def test_held_pull_answered_when_topic_deleted(addr):
    await _topic(addr, "T", 1)
    async with PullConsumer(addr, "g") as c, Admin(addr) as admin:
        pull = asyncio.create_task(c.pull("T", 0, 0, suspend=5))
        await asyncio.sleep(0.05)
        await admin.delete_topic("T")
        with pytest.raises(OnceqError) as ei:
            await asyncio.wait_for(pull, 2)
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST


async def test_held_pull_of_closed_connection_is_dropped(broker, addr):
    await _topic(addr, "T", 1)
    c = await PullConsumer(addr, "g").start()
    pull = asyncio.create_task(c.pull("T", 0, 0, suspend=5))
    await asyncio.sleep(0.05)
    assert broker.holds.holders_of(("T", 0))
    await c.close()
    with pytest.raises(OnceqError):
        await pull
    for _ in range(100):
        if not broker.holds.holders_of(("T", 0)):
            break
        await asyncio.sleep(0.01)
    assert not broker.holds.holders_of(("T", 0))
    async with Producer(addr) as p:
        await p.send("T", b"after")  # notifying an empty hold list is harmless


async def test_held_pulls_are_answered_at_broker_stop(tmp_path):
    async with running_broker(str(tmp_path)) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        async with PullConsumer(addr, "g") as c:
            pull = asyncio.create_task(c.pull("T", 0, 0, suspend=10))
            await asyncio.sleep(0.05)
            await b.stop()
            r = await asyncio.wait_for(pull, 2)
            assert r.status == PullStatus.NO_NEW_MESSAGE


async def test_timed_out_request_leaves_nothing_pending(addr):
    await _topic(addr, "T", 1)
    conn = await BrokerConnection.open(addr)
    try:
        with pytest.raises(OnceqError) as ei:
            await conn.request(RequestCode.PULL, {"topic": "T", "queue": 0, "offset": 0,
                                                  "suspend_ms": 5000}, timeout=0.1)
        assert ei.value.code == ErrorCode.SERVICE_UNAVAILABLE
        assert conn.pending == 0
        hdr, _ = await conn.request(RequestCode.PING)  # the connection is still usable
        assert hdr["time"] > 0
        assert conn.pending == 0
    finally:
        conn.close()


# ================================================================ offsets
async def test_min_max_and_search_offset_by_timestamp(addr):
    await _topic(addr, "T", 1)
    async with Producer(addr) as p, PullConsumer(addr, "g") as c:
        assert await c.queue_offsets("T", 0) == (0, 0)
        before = int(time.time() * 1000) - 1
        await p.send_batch("T", [b"a", b"b", b"c"])
        await asyncio.sleep(0.02)
        middle = int(time.time() * 1000)
        await asyncio.sleep(0.002)
        await p.send_batch("T", [b"d", b"e"])
        assert await c.queue_offsets("T", 0) == (0, 5)
        assert await c.search_offset("T", 0, 0) == 0
        assert await c.search_offset("T", 0, before) == 0
        assert await c.search_offset("T", 0, middle) == 3
        assert await c.search_offset("T", 0, int(time.time() * 1000) + 60_000) == 5


async def test_commit_and_fetch_offsets(addr):
    await _topic(addr, "T", 2)
    async with Producer(addr) as p:
        await p.send_batch("T", [b"1", b"2", b"3"], queue=0)
    async with PullConsumer(addr, "g1") as c, PullConsumer(addr, "g2") as c2:
        assert await c.fetch_offset("T", 0) is None
        await c.commit_offset("T", 0, 2)
        assert await c.fetch_offset("T", 0) == 2
        assert await c.fetch_offset("T", 1) is None
        assert await c2.fetch_offset("T", 0) is None  # per group
        # piggy-backed commit on a pull
        r = await c2.pull("T", 0, 0, 1, commit_offset=1)
        assert [m.body for m in r.messages] == [b"1"]
        assert await c2.fetch_offset("T", 0) == 1
        await c2.pull("T", 0, 1, 1, commit_offset=-1)  # -1 means "nothing to commit"
        assert await c2.fetch_offset("T", 0) == 1
        with pytest.raises(OnceqError) as ei:
            await c.commit_offset("T", 9, 0)
        assert ei.value.code == ErrorCode.INVALID_QUEUE
        with pytest.raises(OnceqError) as ei:
            await c.fetch_offset("nope", 0)
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        with pytest.raises(OnceqError) as ei:
            await c.commit_offset("T", 0, -5)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT
    async with Admin(addr) as admin:
        assert await admin.group_offset("g1", "T", 0) == 2
        assert set(await admin.list_groups()) >= {"g1", "g2"}


# ================================================================ consumer groups
class _Member:
    """A raw client connection that heartbeats into a group and records pushes."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.pushes: list[dict[str, Any]] = []
        self.event = asyncio.Event()
        self.conn: BrokerConnection | None = None

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        if code == PushCode.GROUP_CHANGED:
            self.pushes.append(header)
            self.event.set()

    async def open(self, addr: str) -> _Member:
        self.conn = await BrokerConnection.open(addr, self._on_push)
        return self

    async def heartbeat(self, group: str = "G") -> dict[str, Any]:
        hdr, _ = await self.conn.request(RequestCode.HEARTBEAT, {
            "client": self.client_id,
            "groups": [{"group": group, "model": "CLUSTERING", "subs": {"T": "*"}}],
        })
        return hdr

    async def unregister(self, group: str = "G") -> None:
        await self.conn.request(RequestCode.UNREGISTER, {"group": group,
                                                         "client": self.client_id})

    async def next_push(self, timeout: float = 2.0) -> dict[str, Any]:
        if not self.pushes:
            self.event.clear()
            await asyncio.wait_for(self.event.wait(), timeout)
        return self.pushes.pop(0)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


async def test_group_members_and_change_notifications(addr):
    a, b, c = [await _Member(n).open(addr) for n in ("a", "b", "c")]
    try:
        async with Admin(addr) as admin:
            with pytest.raises(OnceqError) as ei:
                await admin.group_members("G")
            assert ei.value.code == ErrorCode.GROUP_NOT_EXIST
            hdr = await a.heartbeat()
            assert hdr["expiry_s"] > 0
            assert (await a.next_push())["reason"] == "join"  # its own join
            await b.heartbeat()
            assert await a.next_push() == {"group": "G", "client": "b", "reason": "join"}
            assert (await b.next_push())["client"] == "b"
            members = await admin.group_members("G")
            assert [m["client"] for m in members] == ["a", "b"]
            assert members[0]["subs"] == {"T": "*"} and members[0]["model"] == "CLUSTERING"
            assert "G" in await admin.list_groups()
            # a repeated heartbeat with the same subscriptions changes nothing
            await a.heartbeat()
            await asyncio.sleep(0.05)
            assert not a.pushes and not b.pushes

            await c.heartbeat()
            assert (await a.next_push())["client"] == "c"
            assert (await b.next_push())["client"] == "c"
            await c.next_push()
            # leave (UNREGISTER)
            await c.unregister()
            assert await a.next_push() == {"group": "G", "client": "c", "reason": "leave"}
            assert (await b.next_push())["reason"] == "leave"
            assert [m["client"] for m in await admin.group_members("G")] == ["a", "b"]
            # connection closed
            b.close()
            assert await a.next_push() == {"group": "G", "client": "b",
                                           "reason": "disconnect"}
            assert [m["client"] for m in await admin.group_members("G")] == ["a"]
    finally:
        for m in (a, b, c):
            m.close()


async def test_member_expires_without_heartbeat(tmp_path):
    async with running_broker(str(tmp_path), heartbeat_expiry_s=0.3,
                              expiry_check_s=0.05) as broker:
        addr = f"127.0.0.1:{broker.port}"
        a, b = await _Member("a").open(addr), await _Member("b").open(addr)
        try:
            await a.heartbeat()
            await b.heartbeat()
            assert (await a.next_push())["client"] == "a"
            assert (await a.next_push())["client"] == "b"
            # keep a alive with heartbeats, let b (connection still open) expire
            t0 = time.monotonic()
            push = None
            while push is None and time.monotonic() - t0 < 3:
                await a.heartbeat()
                with contextlib.suppress(TimeoutError):
                    push = await a.next_push(0.1)
            assert push == {"group": "G", "client": "b", "reason": "expired"}
            assert time.monotonic() - t0 >= 0.2
            async with Admin(addr) as admin:
                assert [m["client"] for m in await admin.group_members("G")] == ["a"]
            # b's next heartbeat brings it back as a new member
            await b.heartbeat()
            assert await a.next_push() == {"group": "G", "client": "b", "reason": "join"}
        finally:
            a.close()
            b.close()


async def test_failing_push_handler_keeps_the_connection(addr):
    calls = []

    def bad_handler(code: int, header: dict[str, Any]) -> None:
        calls.append(header)
        raise RuntimeError("user handler bug")

    conn = await BrokerConnection.open(addr, bad_handler)
    try:
        await conn.request(RequestCode.HEARTBEAT, {"client": "x", "groups": [{"group": "G"}]})
        hdr, _ = await conn.request(RequestCode.PING)
        assert calls and calls[0]["reason"] == "join"
        assert not conn.closed and hdr["time"] > 0
    finally:
        conn.close()


async def test_start_on_a_busy_port_fails_cleanly(broker, tmp_path):
    other = Broker(BrokerConfig(small_store(str(tmp_path / "other")), port=broker.port))
    with pytest.raises(OSError):
        await other.start()
    assert other.flusher is not None and other.flusher._task.done()
    # its store was closed: the same directory opens again
    async with running_broker(str(tmp_path / "other")) as again:
        assert again.port != broker.port


# ================================================================ flush
async def test_sync_flush_group_commit(tmp_path):
    async with running_broker(str(tmp_path), {"flush": "sync"}) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 4)
        async with Producer(addr) as p:
            r = await p.send("T", b"first")
            assert b.flusher.flushed >= b.store.log.end
            before = b.flusher.fsyncs
            results = await asyncio.gather(*(p.send("T", f"m{i}") for i in range(50)))
            used = b.flusher.fsyncs - before
        assert 1 <= used < 50
        assert len({(x.queue_id, x.offset) for x in results}) == 50
        assert b.flusher.flushed >= b.store.log.end
        total = [len(await _read_queue(addr, "T", q)) for q in range(4)]
        assert sum(total) == 51
        assert r.offset == 0


async def test_sync_flush_ack_waits_for_the_covering_fsync(tmp_path, monkeypatch):
    """A send is acknowledged only after an fsync that started after its write completes,
    even when another flush (the checkpoint's) runs at the same time."""
    import onceq.broker.flush as flush_mod

    real = flush_mod.fsync_all
    done: list[float] = []
    started = threading.Event()  # the first slow fsync is running

    def slow_fsync(files, fds: list) -> None:
        if fds:
            started.set()
            time.sleep(0.3)  # a slow disk (the scenario), not a wait
        real(files, fds)
        if fds:
            done.append(time.monotonic())

    monkeypatch.setattr(flush_mod, "fsync_all", slow_fsync)
    async with running_broker(str(tmp_path), {"flush": "sync",
                                              "checkpoint_interval_ms": 10_000}) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        async with Producer(addr) as p:
            send = asyncio.create_task(p.send("T", b"durable"))
            assert await asyncio.to_thread(started.wait, 10)  # the flusher's slow fsync runs
            await b.flusher.flush_now()  # a concurrent flush (as the checkpoint does)
            await send
            acked = time.monotonic()
        assert done and done[0] <= acked


async def test_sync_send_in_flight_at_stop_is_answered(tmp_path, monkeypatch):
    import onceq.broker.flush as flush_mod

    real = flush_mod.fsync_all
    started = threading.Event()  # the send's fsync is running

    def slow_fsync(files, fds: list) -> None:
        if fds:
            started.set()
            time.sleep(0.2)  # a slow disk (the scenario), not a wait
        real(files, fds)

    monkeypatch.setattr(flush_mod, "fsync_all", slow_fsync)
    async with running_broker(str(tmp_path), {"flush": "sync",
                                              "checkpoint_interval_ms": 10_000}) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        async with Producer(addr, retries=0) as p:
            send = asyncio.create_task(p.send("T", b"at shutdown"))
            assert await asyncio.to_thread(started.wait, 10)  # in flight: its fsync runs
            await b.stop()
            r = await asyncio.wait_for(send, 2)  # answered, not a lost connection
            assert r.offset == 0
    async with running_broker(str(tmp_path)) as b:
        assert [m.body for m in await _read_queue(f"127.0.0.1:{b.port}", "T", 0)] == [
            b"at shutdown"]


async def test_failed_fsync_is_not_acknowledged_and_stops_writes(tmp_path, monkeypatch):
    """A failed fsync is never retried (its pages' state is unknown): the waiting send gets
    STORAGE_ERROR, its record is removed, and writes are refused until a restart."""
    import onceq.broker.flush as flush_mod

    real = flush_mod.fsync_all
    failures = [OSError(errno.EIO, "injected I/O error")]
    calls: list[list[int]] = []

    def failing_fsync(files, fds: list) -> None:
        calls.append(list(fds))
        if failures:
            raise failures.pop()
        real(files, fds)

    async with running_broker(str(tmp_path), {"flush": "sync"}) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 1)
        async with Producer(addr, retries=0) as p:
            await p.send("T", Message(b"kept", unique_key="GOOD-KEY"))
            monkeypatch.setattr(flush_mod, "fsync_all", failing_fsync)
            with pytest.raises(OnceqError) as ei:
                await p.send("T", Message(b"m", unique_key="FSYNC-KEY"))
            assert ei.value.code == ErrorCode.STORAGE_ERROR and ei.value.retriable
            with pytest.raises(OnceqError) as ei:  # no new write, not even the retry
                await p.send("T", Message(b"m", unique_key="FSYNC-KEY"))
            assert ei.value.code == ErrorCode.STORAGE_ERROR
            assert "restart" in ei.value.message
        assert len(calls) == 1  # the failed fsync was not tried again
        assert [m.body for m in await _read_queue(addr, "T", 0)] == [b"kept"]  # reads go on
    async with running_broker(str(tmp_path), {"flush": "sync"}) as b:
        addr = f"127.0.0.1:{b.port}"
        assert [m.body for m in await _read_queue(addr, "T", 0)] == [b"kept"]
        async with Producer(addr, retries=0) as p:  # writes accepted again after a restart
            r = await p.send("T", Message(b"m", unique_key="FSYNC-KEY"))
        assert not r.duplicate and r.offset == 1


# ================================================================ dedup
async def test_producer_retry_is_deduplicated(broker, addr):
    await _topic(addr, "T", 4)
    async with Producer(addr) as p:
        first = await p.send("T", Message(b"pay", unique_key="RETRY-KEY-1"))
        again = await p.send("T", Message(b"pay", unique_key="RETRY-KEY-1"))
        other = await p.send("T", Message(b"pay", unique_key="RETRY-KEY-2"))
        batch = await p.send_batch("T", [Message(b"x", unique_key="RETRY-KEY-1"),
                                         Message(b"new", unique_key="RETRY-KEY-3")], queue=3)
    assert not first.duplicate
    assert again.duplicate
    assert (again.queue_id, again.offset) == (first.queue_id, first.offset)
    assert not other.duplicate
    assert batch[0].duplicate and (batch[0].queue_id, batch[0].offset) == (first.queue_id,
                                                                            first.offset)
    assert not batch[1].duplicate and batch[1].queue_id == 3
    stored = [m for q in range(4) for m in await _read_queue(addr, "T", q)]
    assert sorted(m.unique_key for m in stored) == ["RETRY-KEY-1", "RETRY-KEY-2",
                                                    "RETRY-KEY-3"]


# ================================================================ restart
async def test_restart_keeps_topics_messages_offsets_and_dedup(tmp_path):
    data = str(tmp_path)
    async with running_broker(data) as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "T", 3)
        await _topic(addr, "U", 1)
        async with Producer(addr) as p:
            sent = await p.send_batch("T", [Message(f"m{i}".encode(), tags="A", keys=f"k{i}")
                                            for i in range(5)], queue=1)
            dup_src = await p.send("U", Message(b"once", unique_key="RESTART-KEY"))
        async with PullConsumer(addr, "g") as c:
            await c.commit_offset("T", 1, 3)
    async with running_broker(data) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            assert await admin.list_topics() == [{"topic": "T", "queues": 3},
                                                 {"topic": "U", "queues": 1}]
        msgs = await _read_queue(addr, "T", 1)
        assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(5)]
        assert [m.unique_key for m in msgs] == [r.unique_key for r in sent]
        assert [m.keys for m in msgs] == [f"k{i}" for i in range(5)]
        async with PullConsumer(addr, "g") as c:
            assert await c.fetch_offset("T", 1) == 3
        async with Producer(addr) as p:
            again = await p.send("U", Message(b"once", unique_key="RESTART-KEY"))
            nxt = await p.send("T", b"after", queue=1)
        assert again.duplicate and (again.queue_id, again.offset) == (dup_src.queue_id,
                                                                      dup_src.offset)
        assert nxt.offset == 5
        assert len(await _read_queue(addr, "U", 0)) == 1


# ================================================================ blocking clients
def test_sync_clients_from_plain_code(tmp_path):
    proc, addr = spawn_broker(str(tmp_path / "data"))
    try:
        asyncio.run(_topic(addr, "S", 2))
        with SyncProducer(addr) as p:
            r = p.send("S", Message(b"hello", tags="t"), queue=1)
            rs = p.send_batch("S", [b"a", b"b"], queue=1)
            p.send_oneway("S", b"c", queue=1)
            dup = p.send("S", Message(b"hello", unique_key=r.unique_key))
        assert (r.queue_id, r.offset) == (1, 0)
        assert [x.offset for x in rs] == [1, 2]
        assert dup.duplicate and dup.offset == 0
        with SyncPullConsumer(addr, "sync-group") as c:
            deadline = time.monotonic() + 5
            while True:  # the one-way send may land a moment later
                res = c.pull("S", 1, 0, 10)
                if len(res.messages) == 4 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert [m.body for m in res.messages] == [b"hello", b"a", b"b", b"c"]
            assert res.messages[0].tags == "t"
            assert c.fetch_offset("S", 1) is None
            c.commit_offset("S", 1, res.next_offset)
            assert c.fetch_offset("S", 1) == 4
            res = c.pull("S", 1, 4, suspend=0.1)
            assert res.status == PullStatus.NO_NEW_MESSAGE
            assert c.queue_count("S") == 2
            assert c.queue_offsets("S", 1) == (0, 4)
            assert c.search_offset("S", 1, 0) == 0
            with pytest.raises(OnceqError) as ei:
                c.pull("nope", 0, 0)
            assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        c.close()  # closing twice is harmless
        assert not [t for t in threading.enumerate() if t.name == "onceq-client"]
    finally:
        proc.terminate()
        proc.wait(10)
    # the broker is gone: construction fails cleanly and leaves no client thread behind
    with pytest.raises(OnceqError) as ei:
        SyncProducer(addr)
    assert ei.value.code == ErrorCode.SERVICE_UNAVAILABLE
    with pytest.raises(OnceqError):
        SyncPullConsumer(addr)
    assert not [t for t in threading.enumerate() if t.name == "onceq-client"]
