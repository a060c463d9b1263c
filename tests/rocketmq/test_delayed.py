"""Delayed messages of RocketMQ 5 clients: the mapping of ``delivery_timestamp`` (pure),
and the official client's delayed messages accepted by onceq's gRPC endpoint and
delivered at their time (``rmq_proc.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("google.protobuf")

from onceq import Admin, PullConsumer
from onceq.log.delay import DELAYED, PROP_TIMER_DELIVER_MS
from onceq.log.record import decode_records
from onceq.protocol.codes import PullStatus
from onceq.rocketmq._pb import definition_pb2 as pb
from onceq.rocketmq.mapping import RmqError, route, to_part, to_pb, to_send

from .conftest import RmqBroker

T_MS = 1_700_000_000_000


def _message(deliver_ms: int | None = None, mtype: int = pb.DELAY, group: str = ""
             ) -> pb.Message:
    m = pb.Message()
    m.topic.name = "orders"
    m.body = b"later"
    sp = m.system_properties
    sp.message_id = "0102FC000000ABCDEF"
    sp.message_type = mtype  # type: ignore[assignment]
    sp.born_timestamp.FromMilliseconds(T_MS)
    if deliver_ms is not None:
        sp.delivery_timestamp.FromMilliseconds(deliver_ms)
    if group:
        sp.message_group = group
    m.user_properties["p"] = "v"
    return m


def _stored(part: bytes):
    from onceq.log.record import build_record
    return next(decode_records(build_record(b"orders", 0, 0, 0, T_MS + 1, part)))


def test_a_delay_message_is_a_delayed_onceq_message_and_comes_back_as_one():
    part = to_part(_message(T_MS + 5_000))
    assert part[9] & (DELAYED >> 8)
    m = _stored(part)
    assert m.properties == {"p": "v", PROP_TIMER_DELIVER_MS: str(T_MS + 5_000)}
    out = to_pb(m, namespace="", receipt="RH", invisible_s=30, attempt=1, store_host="h:1")
    sp = out.system_properties
    assert sp.message_type == pb.DELAY
    assert sp.delivery_timestamp.ToMilliseconds() == T_MS + 5_000
    assert dict(out.user_properties) == {"p": "v"}
    normal = to_part(_message(None, pb.NORMAL))
    assert not normal[9] & (DELAYED >> 8)


@pytest.mark.parametrize("msg, code", [
    (_message(None), pb.ILLEGAL_DELIVERY_TIME),  # DELAY without a time
    (_message(T_MS, pb.FIFO, group="g"), pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
])
def test_delay_messages_refused(msg, code):
    with pytest.raises(RmqError) as e:
        to_part(msg)
    assert e.value.code == code and e.value.message


def test_too_far_ahead_is_an_illegal_delivery_time():
    to_send(_message(T_MS + 60_000), T_MS, 60)
    to_send(_message(T_MS - 10**9), T_MS, 60)  # the past: at once
    with pytest.raises(RmqError) as e:
        to_send(_message(T_MS + 60_001), T_MS, 60)
    assert e.value.code == pb.ILLEGAL_DELIVERY_TIME
    assert "timer_max_delay_s" in e.value.message


def test_routes_accept_delay_messages():
    where = pb.Endpoints(scheme=pb.IPv4)
    where.addresses.add(host="127.0.0.1", port=8081)
    [q] = route("orders", 1, namespace="", broker="onceq", where=where)
    assert list(q.accept_message_types) == [pb.NORMAL, pb.FIFO, pb.DELAY]


async def _read(addr: str, topic: str) -> list[Any]:
    async with PullConsumer(addr, "reader") as c:
        r = await c.pull(topic, 0, 0, 64, suspend=0)
        return list(r.messages) if r.status == PullStatus.FOUND else []


def test_the_official_client_s_delayed_message_is_delivered_at_its_time(rmq: RmqBroker):
    async def topic() -> None:
        async with Admin(rmq.addr) as a:
            await a.create_topic("delayed-rmq", 1)
    asyncio.run(topic())
    out = rmq.client("produce", topic="delayed-rmq",
                     messages=[{"body": "later", "delay_s": 2, "props": {"p": "v"}}])
    [sent] = out["sent"]
    assert "error" not in sent, sent
    if time.time() < sent["deliver_at_s"] - 0.2:  # not visible before its time
        assert asyncio.run(_read(rmq.addr, "delayed-rmq")) == []
    got = rmq.client("receive", topic="delayed-rmq", group="delayed-g", count=1,
                     wait_s=15)["received"]
    assert [(m["body"], m["message_id"]) for m in got] == [("later", sent["message_id"])]
    assert got[0]["properties"] == {"p": "v"}
    assert got[0]["delivery_timestamp"] == sent["deliver_at_s"] * 1000
    [stored] = asyncio.run(_read(rmq.addr, "delayed-rmq"))
    assert stored.store_ts_ms >= sent["deliver_at_s"] * 1000
    assert stored.store_ts_ms <= sent["deliver_at_s"] * 1000 + 1500
