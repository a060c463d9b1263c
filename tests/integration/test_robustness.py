"""Failure paths found in review: bad schedule messages, re-created topics, broken
strategies, a queue that shrank under its consumer."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, ErrorCode, Message, OnceqError, Producer
from onceq.client.push import ConsumeStatus, PushConsumer
from onceq.log.record import encode_part
from onceq.protocol.codes import PROP_DELIVER_AT, SCHEDULE_TOPIC
from tests.helpers import running_broker

FAST = " ".join(["50ms"] * 18)


async def _wait(pred, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


async def test_a_bad_schedule_message_does_not_block_retries(tmp_path):
    async with running_broker(str(tmp_path / "d"), delay_levels=FAST) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        seen: list[int] = []

        async def listener(msgs, ctx):
            if msgs[0].reconsume_times == 0:
                return ConsumeStatus.RECONSUME_LATER
            seen.append(msgs[0].reconsume_times)

        c = PushConsumer(addr, "g", listener, consume_from="FIRST", rebalance_interval_s=1)
        c.subscribe("T")
        async with c:
            # garbage in the schedule topic (clients cannot send there: stored directly), at
            # the level retries use first
            b.retry.ensure_topics()
            part = encode_part(b"junk", "JUNK", 0, properties={PROP_DELIVER_AT: "not-a-time"})
            b.store.put(SCHEDULE_TOPIC, 2, [part], dedup=False)
            async with Producer(addr) as p:
                await p.send("T", b"x")
            assert await _wait(lambda: seen == [1]), seen


async def test_recreated_topic_is_not_blocked_by_a_stale_lock(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        got: list[str] = []

        async def listener(msgs, ctx):
            got.extend(m.body.decode() for m in msgs)

        a = PushConsumer(addr, "g", listener, consume_from="FIRST", instance_name="a",
                         rebalance_interval_s=1, pull_suspend_s=0.5)
        a.subscribe("T")
        async with a, Producer(addr) as p:
            await p.send("T", b"before")
            assert await _wait(lambda: got == ["before"])
            async with Admin(addr) as admin:
                await admin.delete_topic("T")
                await admin.create_topic("T", 1)
                assert not [r for r in await admin.access_locks("g") if r["topic"] == "T"]
            await p.queue_count("T", refresh=True)
            await p.send("T", b"after")
            assert await _wait(lambda: got == ["before", "after"]), got


async def test_shutdown_still_leaves_cleanly_when_the_strategy_raises(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 2)

        calls: list[str] = []

        def broken(client_id, queues, clients):
            calls.append(client_id)
            raise KeyError("strategy bug")

        c = PushConsumer(addr, "g", lambda msgs, ctx: None, allocate=broken,
                         rebalance_interval_s=0.2)
        c.subscribe("T")
        await c.start()
        assert await _wait(lambda: len(calls) >= 3), calls  # a few failed rebalances
        await c.shutdown()  # does not raise, and the member is gone at once
        assert b.groups.members("g") == []
        async with Admin(addr) as admin:  # with no member and no offset, no group at all
            with pytest.raises(OnceqError) as exc:
                await admin.group_members("g")
            assert exc.value.code == ErrorCode.GROUP_NOT_EXIST


async def test_consumer_follows_a_queue_that_shrank(tmp_path):
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
            # the group's offset lies beyond the queue's end (e.g. a damaged log was cut)
            b.store.commit_offset("g", "T", 0, 50)
        got: list[bytes] = []

        async def listener(msgs, ctx):
            got.extend(m.body for m in msgs)

        c = PushConsumer(addr, "g", listener, rebalance_interval_s=1, pull_suspend_s=0.5)
        c.subscribe("T")
        async with c:
            # moved back to the queue's end (0) and waiting there before anything is sent
            assert await _wait(lambda: [h.job.offset for h in b.holds.holders_of(("T", 0))]
                               == [0])
            async with Producer(addr) as p:
                await p.send_batch("T", [Message(b"a"), Message(b"b")])
            assert await _wait(lambda: got == [b"a", b"b"]), got
        assert b.store.get_offset("g", "T", 0) == 2
