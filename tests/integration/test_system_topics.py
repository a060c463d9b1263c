"""System topics through a running broker: dead letters go back to their group through the
broker (clients cannot send to ``%RETRY%``), and a message at the largest reconsume count
is dead-lettered instead of being retried locally for ever."""

from __future__ import annotations

import asyncio
import time

import pytest

from onceq import Admin, ErrorCode, OnceqError, Producer, PullConsumer
from onceq.client.connection import BrokerConnection
from onceq.client.push import ConsumeStatus, PushConsumer
from onceq.log.record import encode_part
from onceq.log.sequence import SEQUENCED
from onceq.protocol.codes import (
    PROP_DLQ_REASON,
    PROP_ORIGIN_TOPIC,
    RequestCode,
    dlq_topic,
    retry_topic,
)
from tests.helpers import running_broker

U16_MAX = 0xFFFF  # the largest reconsume count a message part holds


async def _send_raw(conn: BrokerConnection, topic: str, part: bytes) -> None:
    await conn.request(RequestCode.SEND, {"topic": topic, "queue": 0},
                       len(part).to_bytes(4, "little") + part)


async def test_dlq_resend_is_copied_by_the_broker(tmp_path):
    """``Admin.resend_dead_letters`` asks the broker to copy the dead letter into the
    group's retry topic: same unique key, properties and reconsume count, no writer's
    flag; a second resend within the dedup window is a duplicate; a resend names the
    group's own dead-letter queue and an offset that holds a dead letter."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
            conn = await BrokerConnection.open(addr)
            try:
                await _send_raw(conn, "T", encode_part(b"x", "K1", 1, properties={"p": "1"},
                                                       reconsume_times=3))
                await conn.request(RequestCode.CONSUMER_SEND_BACK, {
                    "group": "g", "topic": "T", "queue": 0, "offset": 0,
                    "delay_level": -1})
                for header in ({"topic": "T", "queue": 0, "offset": 0},  # not the DLQ
                               {"topic": dlq_topic("other"), "queue": 0, "offset": 0},
                               {"topic": dlq_topic("g"), "queue": 1, "offset": 0},
                               {"topic": dlq_topic("g"), "queue": 0, "offset": 5},
                               {"topic": dlq_topic("g"), "queue": 0, "offset": 0,
                                "resend": "yes"}):
                    with pytest.raises(OnceqError) as e:
                        await conn.request(RequestCode.CONSUMER_SEND_BACK,
                                           {"group": "g", "resend": True, **header})
                    assert e.value.code == ErrorCode.INVALID_ARGUMENT, header
            finally:
                conn.close()
            assert retry_topic("g") not in b.store.topics  # nothing resent so far
            [first] = await admin.resend_dead_letters("g")
            [again] = await admin.resend_dead_letters("g", [0])
        assert (first.topic, first.queue_id, first.offset, first.duplicate, first.error) == (
            retry_topic("g"), 0, 0, False, None)
        assert (again.offset, again.duplicate) == (0, True)
        async with PullConsumer(addr, "inspect") as pc:
            [dead] = (await pc.pull(dlq_topic("g"), 0, 0, 8)).messages
            [copy] = (await pc.pull(retry_topic("g"), 0, 0, 8)).messages
        assert (copy.unique_key, copy.body, copy.reconsume_times) == ("K1", b"x", 4)
        assert copy.properties == dead.properties
        assert copy.properties[PROP_ORIGIN_TOPIC] == "T" and PROP_DLQ_REASON in copy.properties
        assert not copy.flags & SEQUENCED


@pytest.mark.slow
async def test_a_message_at_the_largest_reconsume_count_is_dead_lettered(tmp_path):
    """A message whose reconsume count is already 65535 (the u16's limit) and that the
    listener fails goes to the DLQ (count kept at the limit) and the group's offset moves
    past it: the count must not overflow into a send-back that fails for ever."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        conn = await BrokerConnection.open(addr)
        try:
            await _send_raw(conn, "T", encode_part(b"x", "MAX", 1, reconsume_times=U16_MAX))
        finally:
            conn.close()
        seen: list[int] = []

        async def listener(msgs, ctx):
            seen.extend(m.reconsume_times for m in msgs)
            return ConsumeStatus.RECONSUME_LATER

        c = PushConsumer(addr, "g", listener, consume_from="FIRST", send_back_retry_s=0.2)
        c.subscribe("T")
        async with c, Admin(addr) as admin:
            deadline = time.monotonic() + 10
            while await admin.group_offset("g", "T", 0) != 1:
                assert time.monotonic() < deadline, ("the offset is stuck", seen)
                await asyncio.sleep(0.05)
            letters = await admin.dead_letters("g")
        assert seen == [U16_MAX]
        assert [(m.unique_key, m.reconsume_times) for m in letters] == [("MAX", U16_MAX)]


async def test_the_retry_topic_is_created_at_the_first_send_back_and_consumed_at_once(tmp_path):
    """Heartbeats create no topic: a group's retry topic appears at its first send-back,
    and the broker tells the members, which consume it without waiting for their next
    rebalance (an interval of 10 minutes here)."""
    async with running_broker(str(tmp_path / "d"), delay_levels="100ms 100ms 100ms") as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        seen: list[tuple[str, int]] = []
        done = asyncio.Event()

        async def listener(msgs, ctx):
            seen.extend((m.topic, m.reconsume_times) for m in msgs)
            if msgs[0].reconsume_times == 0:
                return ConsumeStatus.RECONSUME_LATER
            done.set()
            return ConsumeStatus.CONSUME_SUCCESS

        c = PushConsumer(addr, "g", listener, consume_from="FIRST", rebalance_interval_s=600)
        c.subscribe("T")
        async with c:
            async with Admin(addr) as admin:
                assert await admin.group_members("g")  # registered: heartbeats were sent
            assert retry_topic("g") not in b.store.topics
            async with Producer(addr) as p:
                await p.send("T", b"fail once", queue=0)
            await asyncio.wait_for(done.wait(), 10)
        assert retry_topic("g") in b.store.topics
        assert seen == [("T", 0), ("T", 1)]  # the retry, seen under its origin topic


async def test_heartbeats_are_bounded_in_groups_and_create_no_topics(tmp_path):
    """A heartbeat naming many groups creates no topic; a client past its groups, or a
    broker past its groups, is refused with TOO_MANY_GROUPS and nothing changes."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        topics = set(b.store.topics)
        b.consumer_groups.max_groups = 80
        conn = await BrokerConnection.open(addr)
        other = await BrokerConnection.open(addr)
        try:
            def hb(client: str, names: list[str]) -> dict:
                return {"client": client, "groups": [{"group": n, "subs": {}} for n in names]}

            await conn.request(RequestCode.HEARTBEAT, hb("c1", [f"g{i}" for i in range(64)]))
            assert set(b.store.topics) == topics
            with pytest.raises(OnceqError) as exc:
                await conn.request(RequestCode.HEARTBEAT, hb("c1", ["one-more"]))
            assert exc.value.code == ErrorCode.TOO_MANY_GROUPS
            assert "one-more" not in b.groups.groups
            await other.request(RequestCode.HEARTBEAT, hb("c2", [f"h{i}" for i in range(16)]))
            with pytest.raises(OnceqError) as exc:  # 80 groups on the broker
                await other.request(RequestCode.HEARTBEAT, hb("c2", ["h16"]))
            assert exc.value.code == ErrorCode.TOO_MANY_GROUPS
            assert "h16" not in b.groups.groups
            # a group whose last member left is forgotten: its place is free again
            await conn.request(RequestCode.UNREGISTER, {"group": "g0", "client": "c1"})
            await other.request(RequestCode.HEARTBEAT, hb("c2", ["h16"]))
            assert len(b.groups.groups) == 80
        finally:
            conn.close()
            other.close()
