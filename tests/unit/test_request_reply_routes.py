"""The broker's reply routing, pure (fake connections): a reply channel is one
connection's until it closes, a reply goes to that connection as one REPLY push frame per
reply, a late reply or one for a channel nobody holds is dropped and counted."""

from __future__ import annotations

import pytest

from onceq.broker.fields import Call
from onceq.broker.reply_route import MAX_CHANNELS_PER_CONNECTION, ReplyRoutes
from onceq.protocol.codes import PushCode
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.frame import PUSH, FrameDecoder, decode_header
from onceq.protocol.replies import ReplyPush, Routed
from onceq.protocol.requests import ReplyChannel, RouteReply


class FakeConn:
    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.closed = False
        self.frames: list[bytes] = []

    def write_frame(self, frame: bytes) -> None:
        self.frames.append(frame)

    def pushes(self) -> list[ReplyPush]:
        dec = FrameDecoder()
        for f in self.frames:
            dec.feed(f)
        out = []
        for _v, kind, code, corr, header, _payload in dec.frames():
            assert (kind, code, corr) == (PUSH, PushCode.REPLY, 0)
            out.append(ReplyPush.decode(decode_header(header)))
        return out


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def routes():
    return ReplyRoutes(Clock())


def name(routes: ReplyRoutes, conn: FakeConn, channel: str) -> None:
    routes.h_channel(Call(conn, 1), ReplyChannel(channel))  # type: ignore[arg-type]


def reply(routes: ReplyRoutes, channel: str, rid: str, body: bytes, deadline: int = 0,
          born: int = 0) -> Routed:
    return routes.h_reply(Call(FakeConn("responder"), 2),  # type: ignore[arg-type]
                          RouteReply(channel, rid, "rpc", deadline, born, body))


def test_a_reply_goes_to_the_channels_connection_every_one_of_them(routes):
    requester = FakeConn("r")
    name(routes, requester, "ch")
    name(routes, requester, "ch")  # again: no change
    assert reply(routes, "ch", "1", b"a", born=99_990) == Routed(True)
    assert reply(routes, "ch", "2", b"b") == Routed(True)
    assert reply(routes, "ch", "1", b"a") == Routed(True)  # not coalesced with the first
    assert [(p.channel, p.id, p.body) for p in requester.pushes()] == [
        ("ch", "1", b"a"), ("ch", "2", b"b"), ("ch", "1", b"a")]
    assert routes.snapshot() == {"replies": 3, "routed": 3, "dropped_late": 0,
                                 "dropped_gone": 0, "channels": 1}
    assert routes.round_trip.sum == pytest.approx(0.01)  # the one with its send time


def test_late_and_gone_replies_are_dropped_and_counted(routes):
    requester = FakeConn("r")
    name(routes, requester, "ch")
    assert reply(routes, "ch", "1", b"x", deadline=100_000) == Routed(False, "late")
    assert reply(routes, "ch", "2", b"x", deadline=100_001) == Routed(True)
    assert reply(routes, "other", "3", b"x") == Routed(False, "gone")
    requester.closed = True  # closed, its disconnect not handled yet
    assert reply(routes, "ch", "4", b"x") == Routed(False, "gone")
    routes.drop(requester)
    assert reply(routes, "ch", "5", b"x") == Routed(False, "gone")
    assert [p.id for p in requester.pushes()] == ["2"]
    assert routes.dropped == {"late": 1, "gone": 3} and routes.channels == 0


def test_a_channel_is_one_live_connections(routes):
    first, second = FakeConn("1"), FakeConn("2")
    name(routes, first, "ch")
    with pytest.raises(OnceqError) as err:
        name(routes, second, "ch")
    assert err.value.code == ErrorCode.CLIENT_ID_IN_USE and err.value.retriable
    first.closed = True  # the requester reconnected before its old connection was dropped
    name(routes, second, "ch")
    routes.drop(first)  # the late disconnect of the old one leaves the new binding alone
    assert reply(routes, "ch", "1", b"x") == Routed(True)
    assert len(second.pushes()) == 1 and routes.channels == 1


def test_channel_names_and_counts_are_bounded(routes):
    conn = FakeConn("c")
    for bad in ("", "x" * 256):
        with pytest.raises(OnceqError) as err:
            name(routes, conn, bad)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
    for i in range(MAX_CHANNELS_PER_CONNECTION):
        name(routes, conn, f"c{i}")
    with pytest.raises(OnceqError):
        name(routes, conn, "one-more")
    routes.drop(conn)
    assert routes.channels == 0


def test_the_metric_families():
    routes = ReplyRoutes(Clock())
    name(routes, FakeConn("r"), "ch")
    reply(routes, "ch", "1", b"x", born=99_000)
    reply(routes, "gone", "2", b"x")
    fams = {m.name: m for m in routes.metrics()}
    assert fams["onceq_replies"].samples[0].value == 2
    assert fams["onceq_replies_routed"].samples[0].value == 1
    assert {s.labels["reason"]: s.value for s in fams["onceq_replies_dropped"].samples} == {
        "gone": 1, "late": 0}
    assert fams["onceq_reply_channels"].samples[0].value == 1
    count = [s for s in fams["onceq_request_reply_seconds"].samples
             if s.name.endswith("_count")]
    assert count[0].value == 1
