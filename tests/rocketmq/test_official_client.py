"""The official RocketMQ 5 Python client (rocketmq-python-client 5.1.2, an independently
written client) against an onceq broker started with ``--grpc-port``: it runs in child
processes (``rmq_proc.py``), onceq's own clients check what it did."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from onceq import PullConsumer

from .conftest import RmqBroker, make_topic, read_all


async def _committed(addr: str, group: str, topic: str, queues: int = 4
                     ) -> list[int | None]:
    async with PullConsumer(addr, group) as c:
        return [await c.fetch_offset(topic, q) for q in range(queues)]


def _messages(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"body": f"{prefix}-{i}", "tag": f"tag{i % 3}", "keys": [f"order-{i}", f"c-{i}"],
             "props": {"i": str(i), "region": "eu"}} for i in range(n)]


def test_official_producer_messages_read_back_equal_by_onceq(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-produce"))
    sent = _messages("p", 20)
    receipts = rmq.client("produce", topic="rmq-produce", messages=sent[:15])["sent"]
    receipts += rmq.client("produce", topic="rmq-produce", messages=sent[15:],
                           **{"async": True})["sent"]
    stored = asyncio.run(read_all(rmq.addr, "rmq-produce"))
    assert len(stored) == len(sent) == len(receipts)
    by_id = {m.unique_key: m for m in stored}
    for msg, receipt in zip(sent, receipts, strict=True):
        m = by_id[receipt["message_id"]]  # the message id is onceq's unique key
        assert m.body.decode() == msg["body"]
        assert m.tags == msg["tag"]
        assert sorted(m.key_list) == sorted(msg["keys"])
        assert m.properties == msg["props"]
        assert m.queue_offset == receipt["offset"]


def test_official_simple_consumer_receives_acks_and_gets_unacked_back(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-simple"))
    sent = _messages("s", 12)
    rmq.client("produce", topic="rmq-simple", messages=sent)
    out = rmq.client("simple", topic="rmq-simple", group="rmq-g1", n=len(sent),
                     invisible=4, leave=["s-3"], change=["s-5", "s-6"], redeliver=True,
                     drain=True, timeout=40)
    got = [r["body"] for r in out["received"]]
    assert sorted(got) == sorted(m["body"] for m in sent)  # each once
    assert all(r["attempt"] == 1 and not r["corrupted"] for r in out["received"])
    first = {r["body"]: r for r in out["received"]}["s-4"]
    assert (first["tag"], first["keys"], first["props"]) == (
        "tag1", ["c-4", "order-4"], {"i": "4", "region": "eu"})
    # the one left unacknowledged came back after its invisible duration, and only it
    assert [(a["body"], a["attempt"]) for a in out["again"]] == [("s-3", 2)]
    assert out["again"][0]["after"] >= 3.9
    assert out["extra"] == []  # all acknowledged: nothing more is delivered
    # the group's committed offsets moved past every acknowledged message
    stored = asyncio.run(read_all(rmq.addr, "rmq-simple"))
    ends = [1 + max([m.queue_offset for m in stored if m.queue_id == q], default=-1)
            for q in range(4)]
    committed = asyncio.run(_committed(rmq.addr, "rmq-g1", "rmq-simple"))
    assert [c or 0 for c in committed] == ends


def test_simple_consumers_of_two_groups_each_get_everything(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-groups"))
    sent = _messages("g", 6)
    rmq.client("produce", topic="rmq-groups", messages=sent)
    for group in ("rmq-ga", "rmq-gb"):
        out = rmq.client("simple", topic="rmq-groups", group=group, n=6, drain=True)
        assert sorted(r["body"] for r in out["received"]) == sorted(m["body"] for m in sent)
        assert out["extra"] == []


def test_tag_filter(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-tags"))
    rmq.client("produce", topic="rmq-tags", messages=_messages("t", 9))
    out = rmq.client("simple", topic="rmq-tags", group="rmq-gt", n=3, tags="tag2",
                     drain=True)
    assert sorted(r["body"] for r in out["received"]) == ["t-2", "t-5", "t-8"]
    assert out["extra"] == []


def test_retry_of_the_same_message_id_is_stored_once(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-retry"))
    out = rmq.client("resend", topic="rmq-retry", body="once", message_id="0A0B0C0D0E0F0102",
                     times=3)
    answers = out["answers"]
    assert [a["code"] for a in answers] == [20000] * 3
    assert len({(a["message_id"], a["offset"]) for a in answers}) == 1
    stored = asyncio.run(read_all(rmq.addr, "rmq-retry"))
    assert [(m.unique_key, m.body) for m in stored] == [("0A0B0C0D0E0F0102", b"once")]


def test_unknown_topic_is_a_clear_error_in_the_official_client(rmq: RmqBroker):
    out = rmq.client("produce_unknown", topic="rmq-nope")
    assert out["error"] is not None  # the client's own words: "failed to fetch ... route"
    # the status onceq answered, as the client logs it
    assert "40402, topic 'rmq-nope' does not exist on this onceq broker" in rmq.client_log()
    raw = rmq.client("resend", topic="rmq-nope", body="x", message_id="0A0B", times=1)
    assert raw["answers"][0]["code"] == 40402


def test_official_push_consumer_consumes(rmq: RmqBroker):
    asyncio.run(make_topic(rmq.addr, "rmq-push"))
    sent = _messages("u", 8)
    rmq.client("produce", topic="rmq-push", messages=sent)
    out = rmq.client("push", topic="rmq-push", group="rmq-gp", n=8, linger=1, timeout=30)
    assert sorted(out["seen"]) == sorted(m["body"] for m in sent)


def test_two_official_push_consumers_share_the_group_without_duplicates(rmq: RmqBroker):
    """Two members of one group, each with its share of the queues (onceq's allocation):
    every message consumed once, by one of them."""
    asyncio.run(make_topic(rmq.addr, "rmq-push2"))
    members = [rmq.start("push", topic="rmq-push2", group="rmq-gp2", n=10_000, timeout=9)
               for _ in range(2)]
    time.sleep(3)  # both started (settings, first assignment)
    sent = _messages("w", 40)
    rmq.client("produce", topic="rmq-push2", messages=sent)
    seen = [rmq.result(p)["seen"] for p in members]
    together = seen[0] + seen[1]
    assert sorted(together) == sorted(m["body"] for m in sent)  # each once in the group
