"""Delayed messages through a broker: not visible in their queue before their time,
visible after it in time order, with their properties and unique key; refused when too far
ahead or in a batch; each delivered once across a broker SIGKILL."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from onceq import Admin, Message, Producer, PullConsumer
from onceq.client.sync import SyncProducer
from onceq.log.delay import PROP_TIMER_DELIVER_MS, TIMER_BASE_MS
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import running_broker, spawn_broker, wait_until


async def pull_all(addr: str, topic: str, queue: int = 0) -> list:
    async with PullConsumer(addr, group="probe") as c:
        res = await c.pull(topic, queue, 0, 1000, suspend=0)
        return list(res.messages) if res.status == PullStatus.FOUND else []


async def test_delayed_messages_appear_at_their_time_in_time_order(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic("t", queues=1)
        async with Producer(addr) as p:
            now = time.time()
            sent = {}
            for name, delay in (("late", 1.2), ("early", 0.4), ("mid", 0.8)):
                r = await p.send("t", Message(name.encode(), tags="tg",
                                              properties={"p": name}), delay_s=delay)
                assert r.offset == -1 and r.queue_id == 0 and not r.duplicate
                sent[name] = r.unique_key
            at = await p.send("t", b"at", deliver_at=now + 0.6)
            sent["at"] = at.unique_key
            now_msg = await p.send("t", b"now")
        assert [m.body for m in await pull_all(addr, "t")] == [b"now"]
        await wait_until(lambda: _count(addr, 5), 3.0, "the delayed messages")
        got = await pull_all(addr, "t")
        assert [m.body for m in got] == [b"now", b"early", b"at", b"mid", b"late"]
        assert got[0].queue_offset == now_msg.offset
        for m in got[1:]:
            name = m.body.decode()
            assert m.unique_key == sent[name]
            deliver_ms = int(m.properties[PROP_TIMER_DELIVER_MS])
            assert deliver_ms <= m.store_ts_ms <= deliver_ms + TIMER_BASE_MS + 1000
            if name != "at":
                assert m.properties["p"] == name and m.tags == "tg"


async def _count(addr: str, n: int) -> bool:
    return len(await pull_all(addr, "t")) >= n


async def test_retries_refusals_and_the_sync_producer(tmp_path):
    async with running_broker(str(tmp_path / "d"), timer_max_delay_s=60) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as a:
            await a.create_topic("t", queues=2)
        async with Producer(addr) as p:
            msg = Message(b"x", unique_key="FIXED-KEY")
            first = await p.send("t", msg, delay_s=0.3, queue=1)
            again = await p.send("t", msg, delay_s=0.3, queue=1)  # a producer retry
            assert not first.duplicate and again.duplicate
            with pytest.raises(OnceqError) as e:
                await p.send("t", b"far", delay_s=3600)
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            assert "timer_max_delay_s" in e.value.message
            with pytest.raises(OnceqError) as e:
                await p.send_batch("t", [Message(b"a", deliver_at_ms=1), b"b"])
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            past = await p.send("t", b"past", deliver_at=time.time() - 3600, queue=0)
            assert past.offset == -1
        sync = await asyncio.to_thread(SyncProducer, addr)
        try:
            await asyncio.to_thread(sync.send, "t", b"sync", delay_s=0.2, queue=0)
        finally:
            await asyncio.to_thread(sync.close)

        async def ready() -> bool:
            return (len(await pull_all(addr, "t", 1)) == 1
                    and len(await pull_all(addr, "t", 0)) == 2)
        await wait_until(ready, 3.0, "the delayed messages")
        assert [m.unique_key for m in await pull_all(addr, "t", 1)] == ["FIXED-KEY"]
        assert [m.body for m in await pull_all(addr, "t", 0)] == [b"past", b"sync"]


@pytest.mark.slow
async def test_a_sigkilled_broker_delivers_each_pending_message_once(tmp_path):
    """Delayed messages sent, the broker SIGKILLed while some are delivered and some wait,
    restarted: each is delivered once (the dedup window is off: the schedule's own
    progress and its check after a start do it)."""
    data = str(tmp_path / "d")
    proc, addr = spawn_broker(data, "--dedup-window", "0")
    n = 40
    try:
        async with Admin(addr) as a:
            await a.create_topic("t", queues=1)
        async with Producer(addr) as p:
            keys = [(await p.send("t", f"m{i}".encode(), delay_s=0.3 + i * 0.05)).unique_key
                    for i in range(n)]
        await wait_until(lambda: _count(addr, 3), 3.0, "the first deliveries")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        port = int(addr.rsplit(":", 1)[1])
        proc, addr = spawn_broker(data, "--dedup-window", "0", port=port)
        await wait_until(lambda: _count(addr, n), 10.0, "every delayed message")
        await asyncio.sleep(0.5)  # nothing more comes
        got = [m.unique_key for m in await pull_all(addr, "t")]
        assert sorted(got) == sorted(keys)
    finally:
        proc.kill()
        proc.wait(10)
