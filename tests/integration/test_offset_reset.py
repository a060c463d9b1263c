"""Explicit offset resets: refused while a group is live unless forced; a forced reset wins
over running push consumers (they drop the queues and read again from the new offsets)."""

from __future__ import annotations

import asyncio
import time

import pytest

from onceq import Admin, Producer, PushConsumer
from onceq.client.connection import BrokerConnection
from onceq.client.push_config import ConsumeFrom
from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.protocol.codes import PullStatus, PushCode, RequestCode
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import wait_until

G, T = "rg", "rt"
N = 50


async def _fill(addr: str, queues: int = 2, n: int = N) -> None:
    async with Admin(addr) as admin:
        await admin.create_topic(T, queues)
    async with Producer(addr) as p:
        for q in range(queues):
            await p.send_batch(T, [f"{q}-{i}".encode() for i in range(n)], queue=q)


async def _until(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def _offsets(addr: str, queues: int = 2) -> list[int]:
    async with Admin(addr) as admin:
        return [await admin.group_offset(G, T, q) for q in range(queues)]


async def test_reset_without_members_clamps_and_reports(addr):
    await _fill(addr)
    async with Admin(addr) as admin:
        rows = await admin.reset_offsets(G, T, to_offset=7)
        assert [(r.queue_id, r.old_offset, r.new_offset) for r in rows] == [(0, None, 7),
                                                                             (1, None, 7)]
        rows = await admin.reset_offsets(G, T, to_offset=10_000, queue=1)
        assert [(r.queue_id, r.old_offset, r.new_offset) for r in rows] == [(1, 7, N)]
        rows = await admin.reset_offsets(G, T, to_offset=-5)
        assert [r.new_offset for r in rows] == [0, 0]
        rows = await admin.reset_offsets(G, T, to_time_ms=0)  # before everything: the min
        assert [r.new_offset for r in rows] == [0, 0]
        rows = await admin.reset_offsets(G, T, to_time_ms=int(time.time() * 1000) + 60_000)
        assert [r.new_offset for r in rows] == [N, N]  # after everything: the end
        assert [await admin.group_offset(G, T, q) for q in range(2)] == [N, N]
        for kwargs, code in (({"to_offset": 1, "queue": 5}, ErrorCode.INVALID_QUEUE),):
            with pytest.raises(OnceqError) as ei:
                await admin.reset_offsets(G, T, **kwargs)
            assert ei.value.code == code
        with pytest.raises(OnceqError) as ei:
            await admin.reset_offsets(G, "nope", to_offset=1)
        assert ei.value.code == ErrorCode.TOPIC_NOT_EXIST
        with pytest.raises(OnceqError) as ei:
            await admin.reset_offsets(G, OFFSETS_TOPIC, to_offset=1, queue=0)
        assert ei.value.code == ErrorCode.INVALID_ARGUMENT
        with pytest.raises(ValueError):
            await admin.reset_offsets(G, T)


async def _consumer(addr: str, listener, **kw) -> PushConsumer:
    c = PushConsumer(addr, G, listener, consume_from=ConsumeFrom.FIRST, commit_interval_s=0.2,
                     **kw)
    c.subscribe(T)
    return await c.start()


async def test_forced_reset_back_is_read_again_by_a_running_push_consumer(addr):
    await _fill(addr)
    seen: list[tuple[int, int]] = []  # recorded here, asserted outside the listener
    c = await _consumer(addr, lambda msgs, ctx: seen.extend(
        (m.queue_id, m.queue_offset) for m in msgs if m.topic == T))
    try:
        await _until(lambda: len(seen) >= 2 * N)
        deadline = time.monotonic() + 15
        while await _offsets(addr) != [N, N]:
            assert time.monotonic() < deadline, "offsets not committed"
            await asyncio.sleep(0.1)
        assert sorted(seen) == [(q, o) for q in range(2) for o in range(N)]
        async with Admin(addr) as admin:
            with pytest.raises(OnceqError) as ei:
                await admin.reset_offsets(G, T, to_offset=10)
            assert ei.value.code == ErrorCode.GROUP_ACTIVE
            assert c.client_id in ei.value.message
            assert await _offsets(addr) == [N, N]  # refused: nothing moved
            first = len(seen)
            rows = await admin.reset_offsets(G, T, to_offset=10, force=True)
        assert [(r.queue_id, r.old_offset, r.new_offset) for r in rows] == [(0, N, 10),
                                                                             (1, N, 10)]
        await _until(lambda: len(seen) >= first + 2 * (N - 10))
        deadline = time.monotonic() + 15
        while await _offsets(addr) != [N, N]:
            assert time.monotonic() < deadline, "offsets not committed after the reset"
            await asyncio.sleep(0.1)
        again = seen[first:]
        assert sorted(again) == [(q, o) for q in range(2) for o in range(10, N)]
        assert c.stats["offset_resets"] == 1
        assert sorted((q.topic, q.queue_id) for q in c.assignment if q.topic == T) == [
            (T, 0), (T, 1)]
    finally:
        await c.shutdown()


async def test_forced_reset_forward_is_not_undone_by_a_busy_consumer(addr):
    """The consumer is stuck on offset 5 of queue 0 (its commit would be 5) when the group
    is moved to 20: it must neither commit 5 nor read 5..19 again."""
    await _fill(addr, queues=1)
    seen: list[int] = []
    gate = asyncio.Event()

    async def listener(msgs, ctx):
        for m in msgs:
            seen.append(m.queue_offset)
            if m.queue_offset == 5 and not gate.is_set():
                await gate.wait()

    c = await _consumer(addr, listener, batch_size=1)
    try:
        await _until(lambda: 5 in seen)
        async def committed_5() -> bool:
            return (await _offsets(addr, 1))[0] == 5

        # periodic commits (every 0.2 s) went out, up to the stuck message and no further
        await wait_until(committed_5, 5, "the commit of 5", interval=0.05)
        assert (await _offsets(addr, 1))[0] <= 5
        async with Admin(addr) as admin:
            rows = await admin.reset_offsets(G, T, to_offset=20, force=True)
        assert [(r.queue_id, r.new_offset) for r in rows] == [(0, 20)]
        first = len(seen)
        await _until(lambda: N - 1 in seen[first:])
        gate.set()  # the stuck listener returns now: its result is thrown away
        deadline = time.monotonic() + 15
        while (await _offsets(addr, 1))[0] != N:
            assert time.monotonic() < deadline, "offsets not committed after the reset"
            await asyncio.sleep(0.1)
        # a stale commit would go out with a periodic commit round (every 0.2 s), each
        # ending in a flush of the offsets: two whole rounds after the offset was seen at N
        offsets = c.coordinator.offsets
        flush = offsets.flush
        rounds = 0

        async def counted_flush() -> None:
            nonlocal rounds
            await flush()
            rounds += 1

        offsets.flush = counted_flush
        await wait_until(lambda: rounds >= 2, 10, "two more periodic commit rounds")
        assert (await _offsets(addr, 1))[0] == N
        after = seen[first:]
        assert sorted(set(after)) == list(range(20, N))  # nothing below the new offset
        assert c.stats["offset_resets"] == 1
    finally:
        gate.set()
        await c.shutdown()


async def test_forced_reset_fences_a_member_until_it_shows_it_saw_the_reset(broker):
    """Requests a member sent before it handled the reset notice must not undo the reset."""
    addr = f"127.0.0.1:{broker.port}"
    await _fill(addr, queues=1)
    pushes: list[tuple[int, dict]] = []
    conn = await BrokerConnection.open(addr, lambda code, h: pushes.append((code, h)))
    group = {"group": G, "model": "CLUSTERING", "subs": {T: "*"}, "held": [[T, 0, 30]]}

    async def req(code: int, **h) -> dict:
        hdr, _ = await conn.request(code, h)
        return hdr

    async def pull(offset: int, **extra) -> dict:
        return await req(RequestCode.PULL, topic=T, queue=0, offset=offset, max=8, group=G,
                         client="a", **extra)

    try:
        await req(RequestCode.HEARTBEAT, client="a", groups=[group])
        assert (await pull(0))["st"] == PullStatus.FOUND
        await req(RequestCode.COMMIT_OFFSET, group=G, topic=T, queue=0, offset=30, client="a")
        async with Admin(addr) as admin:
            await admin.reset_offsets(G, T, to_offset=3, force=True)
        await _until(lambda: any(c == PushCode.OFFSETS_RESET for c, _h in pushes))
        [notice] = [h for c, h in pushes if c == PushCode.OFFSETS_RESET]
        assert notice["group"] == G and notice["queues"] == [[T, 0]]
        gen = notice["gen"]
        assert broker.owners.holder(G, T, 0) is None  # the lock was dropped
        # not seen yet: its commits, pulls, releases and held list change nothing
        with pytest.raises(OnceqError) as ei:
            await req(RequestCode.COMMIT_OFFSET, group=G, topic=T, queue=0, offset=30,
                      client="a")
        assert ei.value.code == ErrorCode.NOT_HOLDER
        assert (await pull(30, commit=30))["st"] == PullStatus.LOCKED
        hb = await req(RequestCode.HEARTBEAT, client="a", groups=[group])
        assert hb["resets"] == [notice] and hb["holds"] == []
        assert broker.owners.holder(G, T, 0) is None
        await req(RequestCode.RELEASE_QUEUE, group=G, client="a", topic=T, queue=0, offset=30)
        assert broker.store.get_offset(G, T, 0) == 3
        # seen: a pull from the new offset takes the queue again, commits count again
        r = await pull(3, reset_gen=gen)
        assert r["st"] == PullStatus.FOUND and broker.owners.holder(G, T, 0) == "a"
        await req(RequestCode.COMMIT_OFFSET, group=G, topic=T, queue=0, offset=11,
                  client="a")
        assert broker.store.get_offset(G, T, 0) == 11
        hb = await req(RequestCode.HEARTBEAT, client="a", groups=[group])
        assert "resets" not in hb
    finally:
        conn.close()
