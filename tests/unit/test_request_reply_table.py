"""The requester's side of request-reply, pure: the request properties, their parse on the
responder's side, the table of waiting requests (matching, late replies, timeouts,
percentiles) and ``ctx.reply``."""

from __future__ import annotations

import asyncio

import pytest

from onceq.client.allocation import MessageQueue
from onceq.client.consume import ConsumeContext
from onceq.client.request_reply import (
    PROP_DEADLINE,
    PROP_REPLY_TO,
    PROP_REQUEST_ID,
    PendingRequests,
    RequestInfo,
    RequestTimeout,
    new_channel,
    request_properties,
)
from onceq.log.record import MessageExt
from onceq.protocol.errors import ErrorCode


def msg(props: dict[str, str], offset: int = 7) -> MessageExt:
    return MessageExt("rpc", 0, offset, b"b", "UK", properties=props, born_ts_ms=1000)


def test_request_properties_keep_the_messages_own_and_parse_back():
    props = request_properties({"a": "1", PROP_REPLY_TO: "old"}, "ch", "2f", 5000)
    assert props == {"a": "1", PROP_REPLY_TO: "ch", PROP_REQUEST_ID: "2f",
                     PROP_DEADLINE: "5000"}
    info = RequestInfo.of(msg(props))
    assert info == RequestInfo("ch", "2f", 5000, 1000)
    assert not info.expired(4999) and info.expired(5000)


@pytest.mark.parametrize("props", [{}, {PROP_REPLY_TO: "ch"}, {PROP_REQUEST_ID: "1"},
                                   {PROP_REPLY_TO: "", PROP_REQUEST_ID: "1"}])
def test_a_message_without_channel_or_id_is_no_request(props):
    assert RequestInfo.of(msg(props)) is None


def test_a_bad_deadline_counts_as_none():
    info = RequestInfo.of(msg({PROP_REPLY_TO: "c", PROP_REQUEST_ID: "1",
                               PROP_DEADLINE: "soon"}))
    assert info is not None and info.deadline_ms == 0 and not info.expired(10 ** 15)


def test_channels_are_unique():
    assert len({new_channel() for _ in range(100)}) == 100


async def test_a_reply_resolves_its_request_once_and_a_second_is_late():
    t = PendingRequests()
    loop = asyncio.get_running_loop()
    ids = [t.new_id() for _ in range(3)]
    assert len(set(ids)) == 3
    futs = [t.add(i, loop) for i in ids]
    assert t.resolve(ids[1], b"r1", loop.time())
    assert futs[1].result() == b"r1" and not futs[0].done()
    assert not t.resolve(ids[1], b"again", loop.time())  # a second reply: dropped
    assert not t.resolve("nobody", b"x", loop.time())
    t.finish(ids[0], "timeouts")
    assert futs[0].cancelled()
    assert not t.resolve(ids[0], b"late", loop.time())
    t.finish(ids[2], "given_up")
    t.finish(ids[2], "given_up")  # once only
    assert dict(t.stats) == {"requests": 3, "replies": 1, "late_replies": 3, "timeouts": 1,
                             "given_up": 1}
    assert t.waiting == 0


async def test_latency_percentiles_of_the_latest_round_trips():
    t = PendingRequests()
    loop = asyncio.get_running_loop()
    assert t.latency(0.5) is None
    for ms in range(1, 101):
        rid = t.new_id()
        t.add(rid, loop)
        t._waiting[rid].started = 0.0
        t.resolve(rid, b"", ms / 1000)
    assert t.latency(0.5) == pytest.approx(0.051)
    assert t.latency(0.99) == pytest.approx(0.1)
    assert t.latency(0.0) == pytest.approx(0.001)


def test_the_timeout_error_has_its_stable_code_and_is_not_retriable():
    err = RequestTimeout("1a", "rpc", 0.25)
    assert err.code == ErrorCode.REQUEST_TIMEOUT == 55
    assert not err.retriable and err.request_id == "1a"
    assert "within 0.25s" in err.message and "may still be carried out" in err.message


def test_ctx_reply_keeps_the_body_by_offset_and_refuses_a_plain_message():
    ctx = ConsumeContext(MessageQueue("rpc", 0), 1)
    ctx.reply(msg({PROP_REPLY_TO: "c", PROP_REQUEST_ID: "1"}, offset=3), "text")
    ctx.reply(msg({PROP_REPLY_TO: "c", PROP_REQUEST_ID: "2"}, offset=4), bytearray(b"raw"))
    assert ctx.replies == {3: b"text", 4: b"raw"}
    with pytest.raises(ValueError, match="is no request"):
        ctx.reply(msg({}), b"x")
