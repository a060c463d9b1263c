"""The pure parts of the RocketMQ endpoint, without sockets: receipt handles, the POP
in-flight table, and the mapping of messages, filters and errors."""

from __future__ import annotations

import base64
import gzip

import pytest

pytest.importorskip("google.protobuf")

from onceq.log.message import MessageExt
from onceq.log.part import check_part
from onceq.log.record import decode_records
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.rocketmq._pb import definition_pb2 as pb
from onceq.rocketmq.mapping import (
    Code,
    RmqError,
    crc32_hex,
    parse_filter,
    route,
    status_of,
    to_part,
    to_pb,
)
from onceq.rocketmq.pop import PopTable, StaleReceipt
from onceq.rocketmq.receipt import BadReceipt, Receipt, ReceiptCodec

KEY = b"k" * 32


# ------------------------------------------------------------------ receipt handles
def test_receipt_round_trip():
    codec = ReceiptCodec(KEY)
    r = Receipt("group-1", "orders", 7, 123_456_789_012, 42)
    assert codec.decode(codec.encode(r)) == r


def test_receipt_with_any_byte_flipped_is_refused():
    codec = ReceiptCodec(KEY)
    handle = codec.encode(Receipt("g", "t", 1, 2, 3))
    raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    for i in range(len(raw)):
        for bit in (0x01, 0x80):
            bad = bytearray(raw)
            bad[i] ^= bit
            text = base64.urlsafe_b64encode(bytes(bad)).rstrip(b"=").decode()
            with pytest.raises(BadReceipt):
                codec.decode(text)


def test_receipt_of_another_run_or_garbage_is_refused():
    handle = ReceiptCodec(KEY).encode(Receipt("g", "t", 0, 0, 1))
    with pytest.raises(BadReceipt, match="not issued by this broker"):
        ReceiptCodec(b"x" * 32).decode(handle)
    for junk in ("", "!!!", "AAAA", handle[:-4]):
        with pytest.raises(BadReceipt):
            ReceiptCodec(KEY).decode(junk)


# ------------------------------------------------------------------ the POP table
def test_commit_point_moves_only_past_acknowledged_messages():
    t = PopTable()
    q = t.start("g", "t", 0, committed=-1, first=0)
    gens = {off: t.deliver("g", "t", 0, off, 30, now=0).generation for off in range(4)}
    assert q.commit_point() == 0
    t.ack("g", "t", 0, 2, gens[2])
    t.ack("g", "t", 0, 1, gens[1])
    assert q.commit_point() == 0  # offset 0 is still in flight
    t.ack("g", "t", 0, 0, gens[0])
    assert q.commit_point() == 3
    t.ack("g", "t", 0, 3, gens[3])
    assert q.commit_point() == 4 == q.next


def test_unacknowledged_message_is_due_again_with_a_new_generation():
    t = PopTable()
    t.start("g", "t", 0, committed=5, first=0)
    d1 = t.deliver("g", "t", 0, 5, 10, now=100)
    assert t.due("g", "t", now=109.9) == []
    assert t.next_visible("g", "t") == 110
    assert t.due("g", "t", now=110) == [(0, 5)]
    d2 = t.deliver("g", "t", 0, 5, 10, now=110)
    assert d2.attempt == 2 and d2.generation != d1.generation
    with pytest.raises(StaleReceipt, match="newest receipt handle"):
        t.ack("g", "t", 0, 5, d1.generation)
    t.ack("g", "t", 0, 5, d2.generation)
    with pytest.raises(StaleReceipt, match="not in flight"):
        t.ack("g", "t", 0, 5, d2.generation)


def test_change_invisible_duration_gives_a_new_generation():
    t = PopTable()
    t.start("g", "t", 3, committed=-1, first=0)
    d = t.deliver("g", "t", 3, 0, 1, now=0)
    nd = t.change("g", "t", 3, 0, d.generation, 60, now=0.5)
    assert nd.generation != d.generation and nd.visible_at == 60.5 and nd.attempt == 1
    assert t.due("g", "t", now=2) == []
    with pytest.raises(StaleReceipt):
        t.change("g", "t", 3, 0, d.generation, 60, now=1)


def test_restart_at_a_moved_offset_forgets_the_deliveries():
    t = PopTable()
    t.start("g", "t", 0, committed=-1, first=0)
    d = t.deliver("g", "t", 0, 0, 30, now=0)
    q = t.start("g", "t", 0, committed=10, first=0)  # an offsets reset
    assert q.next == 10 and q.commit_point() == 10
    with pytest.raises(StaleReceipt):
        t.ack("g", "t", 0, 0, d.generation)


# ------------------------------------------------------------------ mapping
def _message(**kw) -> pb.Message:
    m = pb.Message()
    m.topic.name = "orders"
    m.body = kw.get("body", b"hello")
    sp = m.system_properties
    sp.message_id = kw.get("message_id", "0102FC000000ABCDEF")
    sp.message_type = kw.get("message_type", pb.NORMAL)
    if "tag" in kw:
        sp.tag = kw["tag"]
    sp.keys.extend(kw.get("keys", []))
    sp.born_timestamp.FromMilliseconds(1_700_000_000_123)
    m.user_properties.update(kw.get("props", {}))
    return m


def _stored(part: bytes) -> MessageExt:
    """The part as a consumer would read it back (through a record of the log)."""
    from onceq.log.record import build_record

    return next(decode_records(build_record(b"orders", 2, 9, 5, 1_700_000_000_999, part)))


def test_send_maps_onto_a_message_part():
    part = to_part(_message(tag="paid", keys=["o-1", "c-7"], props={"region": "eu"}))
    key, tags, size, uk = check_part(part)
    assert (key, tags, size, uk) == (b"0102FC000000ABCDEF", b"paid", 5, b"0102FC000000ABCDEF")
    m = _stored(part)
    assert (m.body, m.tags, m.key_list, m.properties, m.born_ts_ms) == (
        b"hello", "paid", ["o-1", "c-7"], {"region": "eu"}, 1_700_000_000_123)


def test_gzip_body_is_stored_inflated():
    m = _message(body=gzip.compress(b"big body"))
    m.system_properties.body_encoding = pb.GZIP
    assert _stored(to_part(m)).body == b"big body"


@pytest.mark.parametrize("kw, code", [
    ({"message_type": pb.FIFO}, Code.ILLEGAL_MESSAGE_GROUP),  # FIFO needs a group
    ({"message_type": pb.DELAY}, Code.ILLEGAL_DELIVERY_TIME),  # DELAY needs a time
    ({"message_type": pb.TRANSACTION}, Code.UNSUPPORTED),
    ({"message_id": ""}, Code.ILLEGAL_MESSAGE_ID),
    ({"message_id": "é"}, Code.ILLEGAL_MESSAGE_ID),
    ({"keys": ["a b"]}, Code.ILLEGAL_MESSAGE_KEY),
])
def test_sends_onceq_cannot_store_are_refused_clearly(kw, code):
    with pytest.raises(RmqError) as e:
        to_part(_message(**kw))
    assert e.value.code == code and e.value.message


def test_delivery_maps_back_with_receipt_and_crc32_digest():
    m = _stored(to_part(_message(tag="paid", keys=["o-1"], props={"p": "v"})))
    out = to_pb(m, namespace="ns", receipt="RH", invisible_s=30, attempt=2,
                store_host="127.0.0.1:8081")
    sp = out.system_properties
    assert out.body == b"hello" and out.topic.name == "orders"
    assert out.topic.resource_namespace == "ns"
    assert (sp.message_id, sp.tag, list(sp.keys)) == ("0102FC000000ABCDEF", "paid", ["o-1"])
    assert dict(out.user_properties) == {"p": "v"}
    assert sp.body_digest.type == pb.CRC32
    assert sp.body_digest.checksum == crc32_hex(b"hello") == "3610A686"
    assert (sp.receipt_handle, sp.queue_id, sp.queue_offset) == ("RH", 2, 9)
    assert (sp.delivery_attempt, sp.invisible_duration.seconds) == (2, 30)


def test_filters():
    assert parse_filter(None) is None
    assert parse_filter(pb.FilterExpression(type=pb.TAG, expression="*")) is None
    assert parse_filter(pb.FilterExpression(type=pb.TAG, expression="a || b")) == ["a", "b"]
    with pytest.raises(RmqError) as e:
        parse_filter(pb.FilterExpression(type=pb.SQL, expression="a > 1"))
    assert e.value.code == Code.ILLEGAL_FILTER_EXPRESSION


def test_route_announces_writable_normal_fifo_and_delay_queues_on_broker_zero():
    where = pb.Endpoints(scheme=pb.IPv4)
    where.addresses.add(host="127.0.0.1", port=8081)
    qs = list(route("orders", 3, namespace="", broker="onceq", where=where))
    assert [q.id for q in qs] == [0, 1, 2]
    assert all(q.permission == pb.READ_WRITE and q.broker.id == 0
               and list(q.accept_message_types) == [pb.NORMAL, pb.FIFO, pb.DELAY]
               and q.broker.endpoints.addresses[0].port == 8081 for q in qs)


@pytest.mark.parametrize("code, rmq", [
    (ErrorCode.TOPIC_NOT_EXIST, Code.TOPIC_NOT_FOUND),
    (ErrorCode.MESSAGE_TOO_LARGE, Code.MESSAGE_BODY_TOO_LARGE),
    (ErrorCode.BAD_REQUEST, Code.BAD_REQUEST),
    (ErrorCode.SYSTEM_BUSY, Code.TOO_MANY_REQUESTS),
    (ErrorCode.DISK_FULL, Code.INTERNAL_ERROR),  # retried by the official producers
])
def test_errors_map_to_rocketmq_codes(code, rmq):
    got, message = status_of(OnceqError(code, "why"))
    assert got == rmq and message == f"{code.name}: why"


def test_a_pulls_records_before_the_cursor_are_not_taken_again():
    """A pull answers whole records: two receives woken by one message must not both take
    it (the second reads from the cursor the first moved)."""
    from onceq.log.record import build_record
    from onceq.protocol.codes import PullStatus
    from onceq.protocol.replies import PullReply
    from onceq.rocketmq.consume import decode

    payload = b"".join(build_record(b"orders", 0, off, off * 100, 0,
                                    to_part(_message(message_id=f"ID{off}")))
                       for off in range(3))
    reply = PullReply(PullStatus.FOUND, 3, 0, 3, 3, payload=payload)
    assert [m.queue_offset for m in decode(reply, 1, 3, None)] == [1, 2]
    assert decode(reply, 3, 3, None) == []
