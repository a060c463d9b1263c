"""The broker's delivery trace: what it records, only for traced groups, kept across a
restart, and bad switch requests."""

from __future__ import annotations

import asyncio
import json

import pytest

from onceq import Admin, Message, OnceqError, Producer
from onceq.client.push import PushConsumer
from onceq.log.record import decode_records
from onceq.protocol.codes import TRACE_TOPIC, PullStatus, RequestCode
from onceq.protocol.errors import ErrorCode
from tests.helpers import running_broker


async def _trace(admin: Admin) -> list:
    out = []
    for q in range(await admin.queue_count(TRACE_TOPIC)):
        lo, hi = await admin.queue_offsets(TRACE_TOPIC, q)
        if hi > lo:
            h, payload = await admin._request(RequestCode.PULL, {
                "topic": TRACE_TOPIC, "queue": q, "offset": lo, "max": 1000})
            assert h["st"] == PullStatus.FOUND
            out += decode_records(payload)
    return sorted(out, key=lambda m: m.born_ts_ms)


async def test_trace_records_deliveries_and_members_of_traced_groups(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("tr", 2)
            assert await admin.group_trace("tr-g", True) is True
            async with Producer(addr) as p:
                sent = {(await p.send("tr", Message(b"%d" % i), queue=i % 2)).unique_key
                        for i in range(6)}
            seen: list = []

            async def listener(msgs, ctx):
                seen.extend(msgs)

            for group in ("tr-g", "tr-off"):
                c = PushConsumer(addr, group, listener, consume_from="FIRST",
                                 instance_name=f"{group}-1")
                c.subscribe("tr")
                await c.start()
                for _ in range(100):
                    if len(seen) >= (6 if group == "tr-g" else 12):
                        break
                    await asyncio.sleep(0.05)
                await c.shutdown()
            assert len(seen) == 12
            recs = await _trace(admin)
        pulls = [m for m in recs if m.properties["kind"] == "deliver"]
        assert {m.properties["group"] for m in recs if "group" in m.properties} == {"tr-g"}
        deliveries = [(m.properties, d) for m in pulls for d in json.loads(m.body)]
        assert {d["k"] for _p, d in deliveries} == sent and len(deliveries) == 6
        for p, d in deliveries:
            assert p["topic"] == "tr" and p["client"].endswith("#tr-g-1")
            assert d["r"] == 0
        assert sorted((int(p["queue"]), d["o"]) for p, d in deliveries) == [
            (q, o) for q in (0, 1) for o in range(3)]
        # the pull that took each queue's access lock is marked (lock on by default)
        assert {m.properties["queue"] for m in pulls
                if m.properties["handover"] == "1"} == {"0", "1"}
        events = [m.properties["event"] for m in recs if m.properties["kind"] == "member"]
        assert events[0] == "join" and events[-1] == "leave"
        # each record's place in the broker's order (records share a millisecond)
        seqs = sorted(int(m.properties["seq"]) for m in recs)
        assert seqs == list(range(1, len(recs) + 1))
        assert all(m.properties["src"] == "broker" for m in recs)  # the audit's mark
    # kept across a restart, with a broker-start record for the audit
    async with running_broker(str(tmp_path / "data")) as b:
        assert b.trace.groups == {"tr-g"}
        async with Admin(f"127.0.0.1:{b.port}") as admin:
            assert await admin.group_trace("tr-other") is False
            assert await admin.group_trace("tr-g", False) is False
            recs = await _trace(admin)
        assert recs[-1].properties == {"kind": "broker", "event": "start", "seq": "1",
                                       "src": "broker"}
    async with running_broker(str(tmp_path / "data")) as b:
        assert b.trace.groups == set()


async def test_trace_switch_bad_input(tmp_path):
    async with running_broker(str(tmp_path / "data")) as b, \
            Admin(f"127.0.0.1:{b.port}") as admin:
        for header, code in (({"group": "g", "enabled": "yes"}, ErrorCode.INVALID_ARGUMENT),
                             ({"group": "a b", "enabled": True}, ErrorCode.INVALID_NAME),
                             ({"group": 7}, ErrorCode.INVALID_NAME)):
            with pytest.raises(OnceqError) as exc:
                await admin._request(RequestCode.GROUP_TRACE, header)
            assert exc.value.code == code
        assert b.trace.groups == set()
        await admin.create_topic("t", 1)
        for header in ({"topic": "t"}, {"topic": 1, "key": "k"},
                       {"topic": "t", "key": "k", "max_scan": 0},
                       {"topic": "t", "key": "k", "max_results": True},
                       {"topic": "t", "key": "k", "begin_ms": 5, "end_ms": 4}):
            with pytest.raises(OnceqError) as exc:
                await admin._request(RequestCode.QUERY_MESSAGE, header)
            assert exc.value.code == ErrorCode.INVALID_ARGUMENT, header
        with pytest.raises(OnceqError) as exc:
            await admin.query_message("nope", "k")
        assert exc.value.code == ErrorCode.TOPIC_NOT_EXIST
        with pytest.raises(OnceqError) as exc:
            await admin.topic_status("nope")
        assert exc.value.code == ErrorCode.TOPIC_NOT_EXIST


async def test_a_large_pull_is_traced_in_bodies_below_the_max_body(tmp_path):
    async with running_broker(str(tmp_path / "data"), store_kw={"max_body": 2048}) as b, \
            Admin(f"127.0.0.1:{b.port}") as admin:
        await admin.create_topic("big", 1)
        await admin.group_trace("big-g", True)
        async with Producer(f"127.0.0.1:{b.port}") as p:
            sent = [r.unique_key for r in await p.send_batch("big", [b"x"] * 200, queue=0)]
        h, _ = await admin._request(RequestCode.PULL, {
            "topic": "big", "queue": 0, "offset": 0, "max": 200, "group": "big-g",
            "client": "c1"})
        assert h["n"] == 200
        pulls = [m for m in await _trace(admin) if m.properties["kind"] == "deliver"]
        assert len(pulls) > 1 and all(len(m.body) <= 2048 for m in pulls)
        assert [d["k"] for m in pulls for d in json.loads(m.body)] == sent
        assert [d["o"] for m in pulls for d in json.loads(m.body)] == list(range(200))
        assert b.trace.dropped == 0


async def test_message_queries_are_bounded_and_each_accepted_one_is_answered(tmp_path):
    """Message queries are bounded scans that queue for their turn (two read at once):
    past ``max_scans`` running or waiting, a query is refused with SYSTEM_BUSY (retriable)
    and the others are answered in full; the broker keeps serving meanwhile."""
    async with running_broker(str(tmp_path / "d")) as b:
        addr = f"127.0.0.1:{b.port}"
        b.admin.max_scans = 3
        async with Admin(addr) as admin:
            await admin.create_topic("Q", 1)
        async with Producer(addr) as p:
            for i in range(0, 6000, 500):
                await asyncio.gather(*(p.send("Q", Message(b"x", keys=f"k{j}"), queue=0)
                                       for j in range(i, i + 500)))
        async with Admin(addr) as admin:
            results = await asyncio.gather(
                *(admin.query_message("Q", "k5999", by="keys") for _ in range(10)),
                admin.ping(), return_exceptions=True)
        busy = [r for r in results if isinstance(r, OnceqError)]
        answers = [r for r in results[:-1] if not isinstance(r, BaseException)]
        assert busy and all(e.code == ErrorCode.SYSTEM_BUSY and e.retriable for e in busy)
        assert 3 <= len(answers) == 10 - len(busy)
        assert all([m["offset"] for m in r["messages"]] == [5999] for r in answers)
        assert not isinstance(results[-1], BaseException)
        assert not b.admin._scans
