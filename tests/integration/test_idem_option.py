"""The idempotency layer as a consumer option (``PushConsumer(..., idempotency=...)``), and
the reason a parked message carries into the DLQ (``DLQ_REASON``).

Everything is recorded inside the listeners and asserted here, outside them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from onceq import Admin, Message, Producer, PullConsumer
from onceq.client.push import PushConsumer
from onceq.idempotency import Idempotency, MemoryStore
from onceq.protocol.codes import (
    MAX_DLQ_REASON,
    PROP_DLQ_REASON,
    RequestCode,
    dlq_topic,
)
from onceq.protocol.errors import ErrorCode, OnceqError
from tests.helpers import running_broker
from tests.integration.test_push_consumer import FAST_LEVELS, wait_until


async def dead_letters(addr: str, group: str) -> list:
    async with PullConsumer(addr, "reader") as pc:
        r = await pc.pull(dlq_topic(group), 0, 0, 64)
    return list(r.messages)


async def test_consumer_option_async_listener_batches_ack_index_and_dlq_reasons(tmp_path):
    """An async listener given ``idempotency=URL``: batches of 8 where the listener
    acknowledges only the first half of each batch the first time (``ack_index``); the
    rest comes back through the broker's retries and runs once. Then a re-sent order with
    another body and a message without the key property go to the DLQ, each with its
    reason in ``DLQ_REASON``."""
    n = 40
    url = f"sqlite:///{tmp_path}/dedup.db"
    async with running_broker(str(tmp_path / "data"), delay_levels=FAST_LEVELS) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr) as p:
            for i in range(n):
                await p.send("T", Message(f"order {i}".encode(), properties={"order": f"O{i}"}))
        ran: Counter[str] = Counter()
        cut: set[str] = set()

        async def handle(msgs, ctx):
            first = msgs[0].properties["order"]
            take = msgs if first in cut or len(msgs) == 1 else msgs[:len(msgs) // 2]
            cut.add(first)
            ran.update(m.properties["order"] for m in take)
            ctx.ack_index = len(take) - 1

        c = PushConsumer(addr, "billing", handle, consume_from="FIRST", batch_size=8,
                         idempotency=Idempotency(url, key="property:order"))
        c.subscribe("T")
        await c.start()
        try:
            guard = c.idempotent_listener
            await wait_until(lambda: len(ran) == n, 30, "every order handled")
            async with Producer(addr) as p:
                await p.send("T", Message(b"another body", properties={"order": "O3"}))
                await p.send("T", Message(b"no order property"))
                await p.send("T", Message(b"order 5", properties={"order": "O5"}))
            await wait_until(lambda: guard.stats["conflict"] == 1 and guard.stats["no_key"] == 1
                             and guard.stats["duplicate"] >= 1, 30, "re-sends decided")
            dlq = []
            deadline = time.monotonic() + 10
            while len(dlq) < 2 and time.monotonic() < deadline:
                dlq = await dead_letters(addr, "billing")
                await asyncio.sleep(0.05)
        finally:
            await c.shutdown()
        assert set(ran) == {f"O{i}" for i in range(n)} and set(ran.values()) == {1}
        assert guard.stats["handled"] == n and guard.stats["released"] > 0
        reasons = {m.body: m.properties.get(PROP_DLQ_REASON, "") for m in dlq}
        assert set(reasons) == {b"another body", b"no order property"}, reasons
        assert "'O3' already seen with another payload" in reasons[b"another body"]
        assert reasons[b"no order property"].startswith("idempotency: no dedup key")
        with pytest.raises(Exception, match="closed"):  # the option's store was closed
            await guard.store.get("billing", "T", "O1")


@pytest.mark.slow
async def test_sync_consumer_with_a_store_url_option(fast_retry_addr, tmp_path):
    """A plain function in a ``SyncPushConsumer(..., idempotency=URL,...)``: an order the
    application sends twice (same unique key cannot be reused, so the option's key is the
    order property) is handled once."""
    from onceq import SyncProducer, SyncPushConsumer

    addr = fast_retry_addr
    async with Admin(addr) as admin:
        await admin.create_topic("T", 2)
    url = f"sqlite:///{tmp_path}/dedup.db"

    def body() -> tuple[list[str], dict]:
        handled: list[str] = []
        lock = threading.Lock()
        with SyncProducer(addr) as p:
            for i in list(range(10)) + list(range(0, 10, 2)):
                p.send("T", Message(f"order {i}".encode(), properties={"order": f"O{i}"}))

        def handle(msgs, ctx):  # plain function
            with lock:
                handled.extend(m.properties["order"] for m in msgs)

        c = SyncPushConsumer(addr, "billing", handle, subscriptions={"T": "*"},
                             consume_from="FIRST",
                             idempotency=Idempotency(url, key="property:order"))
        with c:
            guard = c.idempotent_listener
            deadline = time.monotonic() + 45  # a re-send seen BUSY comes back from retry
            while guard.stats["handled"] + guard.stats["duplicate"] < 15:
                assert time.monotonic() < deadline, dict(guard.stats)
                time.sleep(0.05)
        return handled, dict(guard.stats)

    handled, stats = await asyncio.wait_for(asyncio.to_thread(body), 60)
    assert sorted(handled) == sorted(f"O{i}" for i in range(10))
    assert stats["duplicate"] == 5


async def test_option_accepts_a_store_object_and_rejects_unknown_settings(addr):
    store = MemoryStore()
    ran: list[str] = []

    async def handle(msgs, ctx):
        ran.extend(m.unique_key for m in msgs)

    async with Admin(addr) as admin:
        await admin.create_topic("T", 1)
    async with Producer(addr) as p:
        sent = [(await p.send("T", b"x")).unique_key for _ in range(3)]
    c = PushConsumer(addr, "g", handle, consume_from="FIRST", idempotency=store)
    c.subscribe("T")
    async with c:
        await wait_until(lambda: len(ran) == 3, 20, "consumed")
    assert ran == sent
    recs = [await store.get("g", "T", k) for k in sent]
    assert all(r is not None and r.status == "CONSUMED" for r in recs)
    with pytest.raises(TypeError, match=r"unknown idempotency option.*leese_s"):
        Idempotency("sqlite://", leese_s=3)
    with pytest.raises(TypeError, match="URL or a DedupStore"):
        Idempotency(42)  # type: ignore[arg-type]


async def test_send_back_reason_is_checked_and_defaults_for_used_up_retries(addr):
    async with Admin(addr) as admin:
        await admin.create_topic("T", 1)
    async with Producer(addr) as p:
        await p.send("T", b"a")
        await p.send("T", b"b")
    async with PullConsumer(addr, "g") as pc:
        base = {"group": "g", "topic": "T", "queue": 0, "delay_level": -1}
        for bad, what in ((7, "must be a string"), ("x" * (MAX_DLQ_REASON + 1), "longer")):
            with pytest.raises(OnceqError) as ei:
                await pc._request(RequestCode.CONSUMER_SEND_BACK,
                              {**base, "offset": 0, "dlq_reason": bad})
            assert ei.value.code == ErrorCode.INVALID_ARGUMENT and what in str(ei.value)
        await pc._request(RequestCode.CONSUMER_SEND_BACK, {**base, "offset": 0})
        await pc._request(RequestCode.CONSUMER_SEND_BACK,
                      {**base, "offset": 1, "delay_level": 3, "max_reconsume": 0})
    dlq = await dead_letters(addr, "g")
    assert [m.properties[PROP_DLQ_REASON] for m in dlq] == [
        "sent to the DLQ by the consumer", "retries used up (0 of at most 0)"]


async def test_orderly_consumer_with_the_option_keeps_order_and_effects_once(addr, tmp_path):
    """An ``@orderly`` listener behind the option: each key's orders are handled in their
    send order, and an application re-send of an order (a new unique key, the same order
    id) has no second effect. The guard acknowledges the re-sends by ``ack_index``; the
    orderly service consumes that prefix and goes on in place."""
    from onceq import orderly

    async with Admin(addr) as admin:
        await admin.create_topic("OT", 2)
    sends = [(f"k{i % 3}", i) for i in range(30)]
    async with Producer(addr) as p:
        for key, i in sends:
            await p.send("OT", Message(b"x", properties={"order": f"O{i}"}), sharding_key=key)
        for key, i in sends[::4]:  # re-sent by the application, later, same queue
            await p.send("OT", Message(b"x", properties={"order": f"O{i}"}), sharding_key=key)
    handled: list[tuple[int, int]] = []

    @orderly
    async def listener(msgs, ctx):
        handled.extend((ctx.queue.queue_id, int(m.properties["order"][1:])) for m in msgs)

    c = PushConsumer(addr, "orderly-idem", listener, consume_from="FIRST", batch_size=4,
                     idempotency=Idempotency(f"sqlite:///{tmp_path}/d.db",
                                             key="property:order"))
    c.subscribe("OT")
    await c.start()
    try:
        assert c.orderly
        await wait_until(lambda: c.idempotent_listener.stats["duplicate"] >= 8, 20,
                         "the re-sends")
        stats = dict(c.idempotent_listener.stats)
    finally:
        await c.shutdown()
    assert sorted(i for _q, i in handled) == list(range(30))  # each order's effect once
    for q in {q for q, _i in handled}:
        ids = [i for qq, i in handled if qq == q]
        assert ids == sorted(ids)  # per queue (and so per key), in send order
    assert stats["duplicate"] == 8
