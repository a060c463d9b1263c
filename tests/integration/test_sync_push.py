"""SyncPushConsumer: the push consumer from plain (non-async) code."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from onceq import (
    Admin,
    ConsumeFrom,
    ConsumeStatus,
    OnceqError,
    SyncProducer,
    SyncPushConsumer,
)


async def _topic(addr: str, name: str, queues: int) -> None:
    async with Admin(addr) as admin:
        await admin.create_topic(name, queues)


async def test_sync_push_consumer_consumes_from_plain_code(addr):
    await _topic(addr, "sp", 4)
    n = 60

    def body() -> None:
        with SyncProducer(addr) as p:
            for i in range(n):
                p.send("sp", f"m{i}")
        got: Counter[str] = Counter()
        threads: set[str] = set()
        lock = threading.Lock()
        all_in = threading.Event()

        def listener(msgs, ctx):  # a plain function: runs in the consumer's thread pool
            with lock:
                for m in msgs:
                    got[m.body.decode()] += 1
                threads.add(threading.current_thread().name)
                if len(got) == n:
                    all_in.set()

        c = SyncPushConsumer(addr, "sp-g", listener, subscriptions={"sp": "*"},
                             consume_from=ConsumeFrom.FIRST)
        assert not c.running
        c.start()
        assert c.running
        assert all_in.wait(15), f"got {len(got)} of {n}"
        assert sorted(q.queue_id for q in c.assignment if q.topic == "sp") == [0, 1, 2, 3]
        assert c.stats["consumed"] >= n - 1  # the last call may still be returning
        with pytest.raises(RuntimeError, match="already started"):
            c.start()
        c.shutdown()
        c.shutdown()  # idempotent
        assert not c.running
        assert set(got) == {f"m{i}" for i in range(n)}
        assert max(got.values()) == 1
        assert all(t.startswith("onceq-consume") for t in threads), threads
        assert not [t for t in threading.enumerate() if t.name == "onceq-client"]

        # offsets were committed on shutdown: the next member of the group starts after them
        with SyncProducer(addr) as p:
            p.send("sp", "after")
        again: list[str] = []
        done = threading.Event()

        def second(msgs, ctx):
            again.extend(m.body.decode() for m in msgs)
            done.set()

        c2 = SyncPushConsumer(addr, "sp-g", second)
        c2.subscribe("sp")
        with c2:
            assert done.wait(10)
        assert again == ["after"]

    await asyncio.wait_for(asyncio.to_thread(body), 30)


async def test_sync_push_consumer_retry_status_and_errors(tmp_path):
    from tests.helpers import running_broker

    async with running_broker(str(tmp_path / "d"), delay_levels="50ms 50ms 50ms 50ms") as b:
        addr = f"127.0.0.1:{b.port}"
        await _topic(addr, "sr", 1)

        def body() -> None:
            seen: list[int] = []
            done = threading.Event()

            def listener(msgs, ctx):
                seen.extend(m.reconsume_times for m in msgs)
                if len(seen) < 3:
                    return ConsumeStatus.RECONSUME_LATER
                done.set()
                return ConsumeStatus.SUCCESS

            with SyncPushConsumer(addr, "sr-g", listener, subscriptions=["sr"],
                                  consume_from=ConsumeFrom.FIRST) as c:
                with SyncProducer(addr) as p:
                    p.send("sr", "again and again")
                assert done.wait(15), seen
            assert seen == [0, 1, 2]
            assert c.stats["sent_back"] == 2

            # no subscription / no listener: a clear error, no thread left behind
            with pytest.raises(ValueError, match="subscribe"):
                SyncPushConsumer(addr, "sr-x", listener).start()
            with pytest.raises(ValueError, match="listener"):
                SyncPushConsumer(addr, "sr-x", subscriptions=["sr"]).start()
            with pytest.raises(TypeError, match="unknown consumer setting"):
                SyncPushConsumer(addr, "sr-x", listener, no_such_setting=1)
            # a bad group name is the broker's error; the consumer can be fixed and started
            c = SyncPushConsumer(addr, "bad group", listener, subscriptions=["sr"])
            with pytest.raises(OnceqError, match="INVALID_NAME"):
                c.start()
            assert not c.running
            assert not [t for t in threading.enumerate() if t.name == "onceq-client"]

        await asyncio.wait_for(asyncio.to_thread(body), 30)
