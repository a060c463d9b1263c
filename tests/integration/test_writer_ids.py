"""A writer id is bound to the connection (and, with ACLs, the user) that sends under it:
another client cannot squat it with a far newer epoch and make the writer's later batches
vanish behind "duplicate, 0 stored". The writer gets an error, never a silent success."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, ClientSecurity, ErrorCode, OnceqError
from onceq.broker.users import UserStore
from onceq.client.connection import BrokerConnection, call
from onceq.client.sequenced import SequencedWriter, encode_sequenced
from onceq.log.sequence import MAX_EPOCH_JUMP
from onceq.protocol.requests import SendSequenced
from tests.helpers import running_broker
from tests.integration.test_sequenced_send import T, bodies

SQUAT_EPOCH = 2 ** 62 - 1


def batch(writer: str, epoch: int, seq: int, body: bytes) -> SendSequenced:
    payload = encode_sequenced(writer, epoch, seq, [(body, "", "", "", None)], 1)
    return SendSequenced(T, 0, writer, epoch, seq, payload)


@pytest.fixture
async def broker(tmp_path):
    """A broker with topic ``T`` of one queue."""
    async with running_broker(str(tmp_path / "d")) as b:
        async with Admin(f"127.0.0.1:{b.port}") as a:
            await a.create_topic(T, 1)
        yield b


async def closed(b, conn: BrokerConnection) -> None:
    """Close ``conn`` and wait until the broker has seen it go."""
    n = len(b.connections)
    conn.close()
    while len(b.connections) >= n:
        await asyncio.sleep(0.01)


async def test_a_live_writers_id_cannot_be_squatted(broker):
    addr = f"127.0.0.1:{broker.port}"
    writer = await BrokerConnection.open(addr)
    squatter = await BrokerConnection.open(addr)
    try:
        await call(writer, batch("w/0", 1, 0, b"first"))
        with pytest.raises(OnceqError) as ei:
            await call(squatter, batch("w/0", SQUAT_EPOCH, 0, b"squat"))
        assert ei.value.code == ErrorCode.WRITER_IN_USE and ei.value.retriable
        reply = await call(writer, batch("w/0", 2, 0, b"second"))
        assert (reply.dup, reply.n) == (0, 1)  # stored, not taken for a duplicate
    finally:
        writer.close()
        squatter.close()
    assert await bodies(addr, T, 1) == [b"first", b"second"]


async def test_an_implausible_epoch_jump_is_refused(broker):
    addr = f"127.0.0.1:{broker.port}"
    conn = await BrokerConnection.open(addr)
    try:
        await call(conn, batch("w/0", 1, 0, b"first"))
        with pytest.raises(OnceqError) as ei:
            await call(conn, batch("w/0", 2 + MAX_EPOCH_JUMP, 0, b"far"))
        assert ei.value.code == ErrorCode.INVALID_SEQUENCE
        await call(conn, batch("w/0", 1 + MAX_EPOCH_JUMP, 0, b"near"))  # within reach
    finally:
        conn.close()
    assert await bodies(addr, T, 1) == [b"first", b"near"]


async def test_a_writer_resumes_on_a_new_connection_once_the_old_one_closed(broker):
    addr = f"127.0.0.1:{broker.port}"
    first = await BrokerConnection.open(addr)
    await call(first, batch("w/0", 1, 0, b"a"))
    await closed(broker, first)
    w = SequencedWriter(addr, "w/0", 2)  # a retried task: same writer, next epoch
    try:
        await w.submit(T, 0, 0, [(b"b", "", "", "", None)])
        await w.flush()
    finally:
        await w.close()
    assert (w.stored, w.duplicates) == (1, 0)


async def test_with_acls_a_writer_id_stays_its_users(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    users = UserStore(str(data))
    users.create("root", "root-pw", super=True)
    users.create("mallory", "m-pw", super=True)  # even a user allowed to publish there
    async with running_broker(str(data), acl=True) as b:
        addr = f"127.0.0.1:{b.port}"
        root, mallory = ClientSecurity("root", "root-pw"), ClientSecurity("mallory", "m-pw")
        async with Admin(addr, security=root) as a:
            await a.create_topic(T, 1)
        conn = await BrokerConnection.open(addr, security=root)
        await call(conn, batch("w/0", 1, 0, b"first"))
        await closed(b, conn)  # the writer is away between two batches
        squatter = await BrokerConnection.open(addr, security=mallory)
        try:
            with pytest.raises(OnceqError) as ei:
                await call(squatter, batch("w/0", SQUAT_EPOCH, 0, b"squat"))
            assert ei.value.code == ErrorCode.WRITER_IN_USE
        finally:
            squatter.close()
        conn = await BrokerConnection.open(addr, security=root)
        try:
            reply = await call(conn, batch("w/0", 2, 0, b"second"))
            assert (reply.dup, reply.n) == (0, 1)
        finally:
            conn.close()
