"""Offset commits at the broker: answered once durable, refused from non-holders, and the
internal offsets journal topic kept out of users' reach."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from onceq import Admin, Producer, PullConsumer, PushConsumer
from onceq.client.allocation import MessageQueue
from onceq.client.connection import BrokerConnection
from onceq.client.push_config import ConsumeFrom
from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.protocol.codes import PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.storage.errors import DiskFull
from onceq.storage.files import FileOps
from tests.helpers import running_broker, wait_until

G, T = "g", "t"


class GatedFsync(FileOps):
    """fsync blocks while the gate is closed (it runs in the flush thread)."""

    def __init__(self) -> None:
        self.open_gate = threading.Event()
        self.open_gate.set()
        self.calls = 0

    def fsync(self, fd: int) -> None:
        self.open_gate.wait(10)
        self.calls += 1
        super().fsync(fd)


async def _member(addr: str, client: str) -> BrokerConnection:
    conn = await BrokerConnection.open(addr)
    await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [
        {"group": G, "model": "CLUSTERING", "subs": {T: "*"}}]})
    return conn


async def _pull(conn: BrokerConnection, client: str, queue: int = 0) -> dict:
    hdr, _ = await conn.request(RequestCode.PULL, {"topic": T, "queue": queue, "offset": 0,
                                                   "max": 32, "group": G, "client": client})
    return hdr


async def _commit(conn: BrokerConnection, offset: int, client: str | None = None,
                  queue: int = 0) -> None:
    h = {"group": G, "topic": T, "queue": queue, "offset": offset}
    if client is not None:
        h["client"] = client
    await conn.request(RequestCode.COMMIT_OFFSET, h)


async def _setup(addr: str, queues: int = 2, n: int = 10) -> None:
    async with Admin(addr) as admin:
        await admin.create_topic(T, queues)
    async with Producer(addr) as p:
        for q in range(queues):
            for i in range(n):
                await p.send(T, f"m{q}-{i}".encode(), queue=q)


async def test_sync_commit_is_answered_only_after_its_fsync(tmp_path):
    files = GatedFsync()
    async with running_broker(str(tmp_path / "d"), {"flush": "sync"}, files=files) as b:
        addr = f"127.0.0.1:{b.port}"
        await _setup(addr, n=50)
        async with PullConsumer(addr, G) as c:
            await c.commit_offset(T, 0, 1)  # the first commit creates the journal topic
            member = await _member(addr, "r")  # creates the group's retry topic
            assert (await _pull(member, "r", 1))["st"] == PullStatus.FOUND  # r holds queue 1
            files.open_gate.clear()
            commit = asyncio.create_task(c.commit_offset(T, 0, 5))
            release = asyncio.create_task(_release(member))
            await wait_until(lambda: (b.store.get_offset(G, T, 0), b.store.get_offset(G, T, 1))
                             == (5, 4), 5, "both applied")
            # an answer sent before the fsync would come at once: a short wait shows none
            await asyncio.sleep(0.1)
            assert not commit.done() and not release.done()  # both wait for the fsync
            assert b.store.get_offset(G, T, 0) == 5  # applied, not answered
            assert b.store.get_offset(G, T, 1) == 4
            before = files.calls
            files.open_gate.set()
            await asyncio.wait_for(asyncio.gather(commit, release), 5)
            assert files.calls > before
            # concurrent commits share fsyncs (group commit)
            rounds = b.flusher.fsyncs
            await asyncio.gather(*(c.commit_offset(T, q % 2, 6 + q) for q in range(40)))
            assert b.flusher.fsyncs - rounds < 40
            # an unchanged offset writes nothing and is answered at once
            rounds = b.flusher.fsyncs
            end = b.store.log.end
            await c.commit_offset(T, 1, 45)
            assert b.store.log.end == end and b.flusher.fsyncs == rounds


async def _release(conn: BrokerConnection) -> None:
    """The holder's release of queue 1, with its final commit."""
    try:
        hdr, _ = await conn.request(RequestCode.RELEASE_QUEUE, {
            "group": G, "client": "r", "topic": T, "queue": 1, "offset": 4})
        assert hdr == {"released": True}
    finally:
        conn.close()


async def test_async_commit_does_not_wait_for_fsync(tmp_path):
    files = GatedFsync()
    async with running_broker(str(tmp_path / "d"), files=files) as b:
        addr = f"127.0.0.1:{b.port}"
        await _setup(addr)
        async with PullConsumer(addr, G) as c:
            await c.commit_offset(T, 0, 1)  # the first commit creates the journal topic
            files.open_gate.clear()
            try:
                await asyncio.wait_for(c.commit_offset(T, 0, 5), 2)
            finally:
                files.open_gate.set()


async def test_commit_from_a_member_without_the_lock_is_refused(addr):
    await _setup(addr)
    a, b = await _member(addr, "a"), await _member(addr, "b")
    try:
        assert (await _pull(a, "a"))["st"] == PullStatus.FOUND  # a holds queue 0
        await _commit(a, 3, "a")
        with pytest.raises(OnceqError) as ei:
            await _commit(b, 9, "b")  # b does not hold it
        assert ei.value.code == ErrorCode.NOT_HOLDER and "holder: a" in ei.value.message
        with pytest.raises(OnceqError) as ei:
            await _commit(b, 1)  # no client id while a member holds the queue
        assert ei.value.code == ErrorCode.NOT_HOLDER
        with pytest.raises(OnceqError) as ei:
            await _commit(b, 1, "b", queue=1)  # nobody holds queue 1: take it by pulling
        assert ei.value.code == ErrorCode.NOT_HOLDER
        async with PullConsumer(addr, G) as c:  # a pull consumer's commit: refused too
            with pytest.raises(OnceqError) as ei:
                await c.commit_offset(T, 0, 0)
            assert ei.value.code == ErrorCode.NOT_HOLDER
            # a pull's piggy-backed commit from a non-holder is dropped (the pull is served)
            r = await c.pull(T, 0, 0, 1, commit_offset=0)
            assert r.status == PullStatus.FOUND
            assert await c.fetch_offset(T, 0) == 3
            # the non-holder's release commits nothing either
            hdr, _ = await b.request(RequestCode.RELEASE_QUEUE, {
                "group": G, "client": "b", "topic": T, "queue": 0, "offset": 0})
            assert hdr == {"released": False}
            assert await c.fetch_offset(T, 0) == 3
    finally:
        a.close()
        b.close()


async def test_pull_consumer_commits_for_a_group_without_members(addr):
    await _setup(addr)
    async with PullConsumer(addr, "lonely") as c:
        await c.commit_offset(T, 0, 4)
        assert await c.fetch_offset(T, 0) == 4
        with pytest.raises(OnceqError) as err:  # offsets never move back by a commit ...
            await c.commit_offset(T, 0, 2)
        assert err.value.code == ErrorCode.OFFSET_BEHIND and "reset" in err.value.message
        with pytest.raises(OnceqError) as err:  # nor past the queue's end (10 messages)
            await c.commit_offset(T, 0, 11)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT and "past the end" in \
            err.value.message
        await c.commit_offset(T, 0, 10)
        assert await c.fetch_offset(T, 0) == 10
    async with Admin(addr) as admin:  # ... only by an explicit reset
        await admin.reset_offsets("lonely", T, to_offset=2, queue=0)  # no member: no force
    async with PullConsumer(addr, "lonely") as c:
        assert await c.fetch_offset(T, 0) == 2


async def test_commit_without_the_lock_for_a_group_that_switched_it_off(addr):
    await _setup(addr)
    conn = await BrokerConnection.open(addr)
    try:
        await conn.request(RequestCode.HEARTBEAT, {"client": "x", "groups": [
            {"group": G, "model": "CLUSTERING", "subs": {T: "*"},
             "meta": {"access_lock": False}}]})
        await _commit(conn, 7, "x")
        hdr, _ = await conn.request(RequestCode.GET_OFFSET, {"group": G, "topic": T,
                                                             "queue": 0})
        assert hdr["offset"] == 7
    finally:
        conn.close()


async def test_push_consumer_takes_a_refused_commit_quietly(broker, caplog):
    addr = f"127.0.0.1:{broker.port}"
    await _setup(addr, queues=1)
    seen: list[int] = []
    c = PushConsumer(addr, G, lambda msgs, ctx: seen.extend(m.queue_offset for m in msgs),
                     consume_from=ConsumeFrom.FIRST, client_id="push-a",
                     commit_interval_s=3600)
    c.subscribe(T)
    await c.start()
    other: BrokerConnection | None = None
    mq = MessageQueue(T, 0)
    try:
        for _ in range(200):
            pq = c.owned.get(mq)
            if pq is not None and pq.commit_offset == 10:
                break
            await asyncio.sleep(0.05)
        assert sorted(seen) == list(range(10))
        assert broker.owners.holder(G, T, 0) == "push-a"
        other = await _member(addr, "zzz")  # sorted after push-a: no queue for it
        before = broker.store.get_offset(G, T, 0)
        # the consumer loses the lock (as in a forced reset) and another member takes it
        # while the consumer's pull is held in long polling; its last commit is still due
        assert broker.owners.core.access.release(group=G, topic=T, queue_id=0,
                                                 client_id="push-a")
        assert (await _pull(other, "zzz"))["st"] == PullStatus.FOUND
        c.offsets.unknown(mq)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="onceq"):
            await c.coordinator.commit_all()  # refused with NOT_HOLDER: no exception
            await c.coordinator.commit_all()  # and not sent again
        assert c.stats["commits_refused"] == 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                    and r.name.startswith("onceq.consumer")]
        assert broker.store.get_offset(G, T, 0) == before
    finally:
        if other is not None:
            other.close()
        await c.shutdown()


async def _offset(addr: str) -> int:
    async with Admin(addr) as admin:
        return await admin.group_offset(G, T, 0)


async def test_offsets_topic_is_hidden_and_refused(addr):
    await _setup(addr, queues=1)
    async with PullConsumer(addr, G) as c:
        await c.commit_offset(T, 0, 3)  # creates the journal topic
    async with Admin(addr) as admin:
        assert [t["topic"] for t in await admin.list_topics()] == [T]
        for call in (admin.delete_topic(OFFSETS_TOPIC),
                     admin.create_topic(OFFSETS_TOPIC, 1)):
            with pytest.raises(OnceqError) as ei:
                await call
            assert ei.value.code == ErrorCode.INVALID_ARGUMENT
            assert "internal" in ei.value.message
    async with Producer(addr) as p:
        with pytest.raises(OnceqError) as ei:
            await p.send(OFFSETS_TOPIC, b"x", queue=0)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT
    async with PullConsumer(addr, G) as c:
        with pytest.raises(OnceqError) as ei:
            await c.pull(OFFSETS_TOPIC, 0, 0, 1)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT
        with pytest.raises(OnceqError) as ei:
            await c.commit_offset(OFFSETS_TOPIC, 0, 1)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT



async def test_commits_go_on_when_the_journal_cannot_be_written(broker, monkeypatch):
    """A full disk: the commit is kept in memory and in the snapshot (as before the
    journal), answered at once, and a pull carrying one is served."""
    addr = f"127.0.0.1:{broker.port}"
    await _setup(addr, queues=1)
    store = broker.store

    def disk_full(*args: object, **kw: object) -> object:
        raise DiskFull("no space left on device")

    monkeypatch.setattr(store.appender, "put", disk_full)
    async with PullConsumer(addr, "lonely") as c:
        r = await c.pull(T, 0, 2, 4, commit_offset=2)
        assert r.status == PullStatus.FOUND and len(r.messages) == 4
        assert await c.fetch_offset(T, 0) == 2
        await c.commit_offset(T, 0, 6)
        assert await c.fetch_offset(T, 0) == 6
    assert store.offsets.snapshot() is not None  # the next snapshot holds it
    assert store.offsets.journal_end() == 0  # nothing was journaled
