"""Attacks on a broker with ACLs on that must fail: each one a test."""

from __future__ import annotations

import json

import pytest

from onceq import Admin, ClientSecurity, ErrorCode, OnceqError, PullConsumer
from onceq.broker.users import UserStore
from onceq.client.connection import BrokerConnection, call
from onceq.log.record import encode_part
from onceq.protocol.codes import RequestCode
from onceq.protocol.requests import (
    Authenticate,
    DeleteTopic,
    GroupBeat,
    Heartbeat,
    Pull,
    ResetOffsets,
    Send,
)
from onceq.protocol.scram import ScramClient
from tests.helpers import running_broker
from tests.integration.test_bad_input import batch as _batch

ROOT = ClientSecurity("root", "root-pw")
ALICE = ClientSecurity("alice", "alice-pw")
NOBODY = ClientSecurity(tls=False)


@pytest.fixture
async def broker(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    UserStore(str(data)).create("root", "root-pw", super=True)
    async with running_broker(str(data), acl=True) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr, security=ROOT) as admin:
            await admin.create_topic("T", 2)
            await admin.create_user("alice", "alice-pw")
        yield b


def _addr(b) -> str:
    return f"127.0.0.1:{b.port}"


async def _code(coro) -> ErrorCode | int:
    try:
        await coro
    except OnceqError as exc:
        return exc.code
    return 0


def _audit(b) -> list[dict]:
    with open(b.security.audit.path) as f:
        return [json.loads(line) for line in f]


async def test_an_anonymous_client_can_do_nothing(broker):
    conn = await BrokerConnection.open(_addr(broker), security=NOBODY)
    try:
        for code in RequestCode:
            if code == RequestCode.AUTHENTICATE:
                continue
            with pytest.raises(OnceqError) as exc:
                await conn.request(code, {})
            assert exc.value.code == ErrorCode.UNAUTHENTICATED, code
    finally:
        conn.close()


async def test_a_wrong_password_and_an_unknown_user_fail_alike(broker):
    wrong = await _code(BrokerConnection.open(_addr(broker), security=ClientSecurity(
        "alice", "nope")))
    unknown = await _code(BrokerConnection.open(_addr(broker), security=ClientSecurity(
        "mallory", "nope")))
    assert wrong == unknown == ErrorCode.AUTH_FAILED


async def test_a_captured_exchange_cannot_be_replayed(broker):
    """An eavesdropper keeps a successful exchange's client messages and sends them again
    on a new connection: the broker's new nonce makes the old proof worthless."""
    conn = await BrokerConnection.open(_addr(broker), security=NOBODY)
    scram = ScramClient("alice", "alice-pw")
    first_msg = scram.first()
    first = await call(conn, Authenticate(first_msg))
    final_msg = scram.final(first.message)
    assert (await call(conn, Authenticate(final_msg))).user == "alice"
    conn.close()
    thief = await BrokerConnection.open(_addr(broker), security=NOBODY)
    try:
        await call(thief, Authenticate(first_msg))
        with pytest.raises(OnceqError) as exc:
            await call(thief, Authenticate(final_msg))
        assert exc.value.code == ErrorCode.AUTH_FAILED
        with pytest.raises(OnceqError) as exc:  # and the connection has no user
            await thief.request(RequestCode.PING, {})
        assert exc.value.code == ErrorCode.UNAUTHENTICATED
    finally:
        thief.close()


async def test_a_connection_keeps_its_user(broker):
    conn = await BrokerConnection.open(_addr(broker), security=ALICE)
    try:
        scram = ScramClient("root", "root-pw")
        with pytest.raises(OnceqError) as exc:
            await call(conn, Authenticate(scram.first()))
        assert exc.value.code == ErrorCode.AUTH_FAILED and "one user" in exc.value.message
        with pytest.raises(OnceqError) as exc:  # still alice: no admin rights
            await conn.request(RequestCode.DELETE_TOPIC, {"topic": "T"})
        assert exc.value.code == ErrorCode.ACCESS_DENIED
    finally:
        conn.close()


async def test_a_consumer_without_the_group_grant_cannot_take_its_queues(broker):
    async with Admin(_addr(broker), security=ROOT) as admin:
        await admin.grant("alice", "Topic", "T", ["Sub"])  # the topic, not the group
    conn = await BrokerConnection.open(_addr(broker), security=ALICE)
    try:
        beat = Heartbeat("c1", [GroupBeat("G", {"T": "*"})])
        assert await _code(call(conn, beat)) == ErrorCode.ACCESS_DENIED
        pull = Pull("T", 0, 0, group="G", client="c1")
        assert await _code(call(conn, pull)) == ErrorCode.ACCESS_DENIED
        assert await _code(call(conn, Pull("T", 0, 0))) == 0  # the topic alone is allowed
    finally:
        conn.close()
    assert broker.groups.members("G") == []
    assert broker.owners.holder("G", "T", 0) is None


async def test_nobody_writes_the_brokers_topics(broker):
    """Not even a super user: the broker alone writes its topics. A user granted every
    topic (``*``) does not reach them either: a wildcard never matches them."""
    async with Admin(_addr(broker), security=ROOT) as admin:
        await admin.grant("alice", "Topic", "*", ["Pub", "Create", "Delete"])
        await admin.grant("alice", "Group", "*", ["Sub"])
    batch = _batch(encode_part(b"forged", "K1", 1))
    for sec, refused in ((ALICE, ErrorCode.ACCESS_DENIED), (ROOT, ErrorCode.INVALID_ARGUMENT)):
        conn = await BrokerConnection.open(_addr(broker), security=sec)
        try:
            for topic in ("%TRACE%", "%SCHEDULE%", "%OFFSETS%", "%DLQ%G", "%RETRY%G"):
                assert await _code(call(conn, Send(topic, 0, batch))) == refused, topic
            assert await _code(call(conn, DeleteTopic("%TRACE%"))) == refused
        finally:
            conn.close()


async def test_another_groups_offsets_cannot_be_reset(broker):
    async with Admin(_addr(broker), security=ROOT) as admin:
        await admin.grant("alice", "Group", "A", ["Update"])
    conn = await BrokerConnection.open(_addr(broker), security=ALICE)
    try:
        other = ResetOffsets("B", "T", [[0, 0]])
        assert await _code(call(conn, other)) == ErrorCode.ACCESS_DENIED
        assert await _code(call(conn, ResetOffsets("A", "T", [[0, 0]]))) == 0
    finally:
        conn.close()
    denied = [e for e in _audit(broker) if e["event"] == "deny"]
    assert denied[-1]["resource"] == "Group:B" and denied[-1]["user"] == "alice"


async def test_brute_force_locks_the_source_out_and_is_logged(broker):
    for _ in range(5):
        assert await _code(BrokerConnection.open(_addr(broker), security=ClientSecurity(
            "alice", "guess"))) == ErrorCode.AUTH_FAILED
    with pytest.raises(OnceqError) as exc:  # now even the right password waits
        await BrokerConnection.open(_addr(broker), security=ALICE)
    assert exc.value.code == ErrorCode.AUTH_FAILED and "too many" in exc.value.message
    events = [e["event"] for e in _audit(broker)]
    assert events.count("login-failed") >= 6


async def test_a_deleted_user_loses_access_at_once(broker):
    async with Admin(_addr(broker), security=ROOT) as admin:
        await admin.grant("alice", "Topic", "T", ["Pub", "Sub"])
        await admin.grant("alice", "Group", "g", ["Sub"])
    async with PullConsumer(_addr(broker), "g", security=ALICE) as c:
        await c.pull("T", 0, 0, 1)
        async with Admin(_addr(broker), security=ROOT) as admin:
            await admin.delete_user("alice")
            assert await admin.list_grants("alice") == []
        with pytest.raises(OnceqError) as exc:
            await c.pull("T", 0, 0, 1)
        assert exc.value.code == ErrorCode.UNAUTHENTICATED


async def test_security_events_are_counted_in_the_metrics(tmp_path):
    from tests.integration.test_metrics import ascrape, get

    data = tmp_path / "d"
    data.mkdir()
    UserStore(str(data)).create("root", "root-pw", super=True)
    async with running_broker(str(data), acl=True, metrics_port=0) as b:
        for _ in range(2):
            assert await _code(BrokerConnection.open(_addr(b), security=ClientSecurity(
                "root", "guess"))) == ErrorCode.AUTH_FAILED
        assert await _code(Admin(_addr(b), security=NOBODY).list_topics()) == \
            ErrorCode.UNAUTHENTICATED
        async with Admin(_addr(b), security=ROOT) as admin:
            await admin.list_topics()
        s = await ascrape(f"http://127.0.0.1:{b.metrics.port}/metrics")
    assert get(s, "onceq_security_events_total", event="login-failed") == 2
    assert get(s, "onceq_security_events_total", event="unauthenticated") == 1
    assert get(s, "onceq_security_events_total", event="login") == 1
