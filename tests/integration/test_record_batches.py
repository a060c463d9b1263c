"""Record batches end to end through a real broker: producers' batches (plain and
compressed) read by pulls from any offset, with tag filters, by a push consumer with a tag
subscription and by the delivery trace; a retried batch is recognised; the data survives a
restart."""

from __future__ import annotations

import asyncio
import json

import pytest

from onceq import Admin, ErrorCode, Message, OnceqError, Producer, PullConsumer, PushConsumer
from onceq.protocol.codes import TRACE_TOPIC, RequestCode
from tests.helpers import running_broker, wait_until


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
async def test_batches_are_read_back_from_any_offset_and_tag(tmp_path, compression):
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("rb", 1)
        tags = ["a", "b", "", "a"] * 10
        async with Producer(addr, compression=compression) as p:
            sent = await p.send_batch("rb", [Message(b"m%d" % i, tags=t, keys=f"k{i}",
                                                     properties={"i": str(i)})
                                             for i, t in enumerate(tags)], queue=0)
            more = await p.send_batch("rb", [b"n0", b"n1"], queue=0)
        assert [r.offset for r in sent + more] == list(range(42))
        bodies = [b"m%d" % i for i in range(40)] + [b"n0", b"n1"]
        async with PullConsumer(addr, "g") as c:
            for start in (0, 1, 17, 39, 40, 41):
                for max_msgs in (1, 5, 32):
                    got, offset = [], start
                    while offset < 42:
                        r = await c.pull("rb", 0, offset, max_msgs)
                        assert len(r.messages) <= max_msgs
                        got += [(m.queue_offset, m.body) for m in r.messages]
                        offset = r.next_offset
                    assert got == list(enumerate(bodies))[start:], (start, max_msgs)
            got, offset = [], 3
            while offset < 42:
                r = await c.pull("rb", 0, offset, 8, tags="a")
                got += [m.queue_offset for m in r.messages]
                offset = r.next_offset
            assert got == [i for i, t in enumerate(tags) if t == "a" and i >= 3]
            m = (await c.pull("rb", 0, 13, 1)).messages[0]
            assert (m.body, m.tags, m.keys, m.properties) == (b"m13", "b", "k13", {"i": "13"})
            assert m.unique_key == sent[13].unique_key
        async with Producer(addr, compression=compression) as p:  # a producer's retry
            again = await p.send_batch("rb", [Message(b"m%d" % i, unique_key=r.unique_key)
                                              for i, r in enumerate(sent[:3])], queue=0)
        assert [(r.offset, r.duplicate) for r in again] == [(0, True), (1, True), (2, True)]
    async with running_broker(str(tmp_path / "data")) as b, \
            PullConsumer(f"127.0.0.1:{b.port}", "g") as c:
        r = await c.pull("rb", 0, 38, 32)
        assert [m.body for m in r.messages] == bodies[38:]


async def test_a_push_consumer_with_a_tag_subscription_and_the_trace_see_each_message_once(
        tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("rp", 2)
            assert await admin.group_trace("rp-g", True) is True
            async with Producer(addr) as p:
                for q in (0, 1):
                    await p.send_batch("rp", [Message(b"%d-%d" % (q, i),
                                                      tags="keep" if i % 3 else "skip")
                                              for i in range(30)], queue=q)
            seen: list = []

            async def listener(msgs, ctx):
                seen.extend((m.queue_id, m.queue_offset, m.tags) for m in msgs)

            c = PushConsumer(addr, "rp-g", listener, consume_from="FIRST", pull_batch_size=7)
            c.subscribe("rp", "keep")
            await c.start()
            want = sorted((q, i, "keep") for q in (0, 1) for i in range(30) if i % 3)
            await wait_until(lambda: len(seen) >= len(want), 20, "the tagged messages")
            await asyncio.sleep(0.2)  # nothing more comes
            await c.shutdown()
            assert sorted(seen) == want
            recs = []
            async with PullConsumer(addr, "reader") as r:
                for q in range(await admin.queue_count(TRACE_TOPIC)):
                    lo, hi = await admin.queue_offsets(TRACE_TOPIC, q)
                    while lo < hi:
                        res = await r.pull(TRACE_TOPIC, q, lo, 64)
                        recs += res.messages
                        lo = res.next_offset
        delivered = sorted((int(m.properties["queue"]), d["o"]) for m in recs
                           if m.properties.get("kind") == "deliver"
                           for d in json.loads(m.body))
        assert delivered == [(q, o) for q, o, _t in want]


async def test_a_producer_falls_back_to_send_batch_with_a_broker_without_record_batches(
        tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        del b.handlers[RequestCode.SEND_RECORDS]  # as a broker of the release before
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("old", 1)
        async with Producer(addr) as p:
            first = await p.send_batch("old", [b"a", b"b", b"c"], queue=0)
            again = await p.send_batch("old", [Message(b"a", unique_key=first[0].unique_key),
                                               b"d"], queue=0)
        assert [r.offset for r in first] == [0, 1, 2]
        assert [(r.offset, r.duplicate) for r in again] == [(0, True), (3, False)]
        assert b.store.topics.queue("old", 0).entry(0)[0] != b.store.topics.queue(
            "old", 0).entry(1)[0]  # single records
        async with PullConsumer(addr, "g") as c:
            r = await c.pull("old", 0, 0, 10)
        assert [m.body for m in r.messages] == [b"a", b"b", b"c", b"d"]


async def test_a_send_of_more_messages_than_a_batch_holds_is_refused_clearly(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b, \
            Producer(f"127.0.0.1:{b.port}") as p:
        with pytest.raises(OnceqError) as err:
            await p.send_batch("big", [b"x"] * 65536, queue=0)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert "at most 65535 messages" in err.value.message
