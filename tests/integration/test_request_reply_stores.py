"""Replies kept with dedup records (``idempotency/replies.py``) on every store: written
only under the claim's owner while it is ``CONSUMING``, read back only once the record is
``CONSUMED`` and alive, gone with the record; an SQL table made without the ``reply``
column gets it on first use and keeps its records."""

from __future__ import annotations

import uuid

import pytest

from onceq.idempotency import Claim, Ticket
from onceq.idempotency.replies import get_replies, keeps_replies, put_replies
from tests.clock import FakeClock
from tests.integration.test_idem_stores import KINDS, RETENTION, drop, make_store


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def clock():
    return FakeClock(1_000_000.0)


@pytest.fixture
def name():
    return f"onceq_rr_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def store(kind, clock, tmp_path, name):
    s = make_store(kind, clock, tmp_path, name)
    yield s
    await drop(s)


BINARY = bytes(range(256)) * 3  # every byte value, not text


async def claimed(store, owner: str, key: str) -> None:
    [res] = await store.claim_many([Claim("g", "rpc", key, owner, "", 10.0, RETENTION)])
    assert res.record.owner == owner


async def test_a_reply_is_kept_by_its_owner_and_answered_once_consumed(store, clock):
    assert keeps_replies(store)
    await claimed(store, "o1", "k1")
    await claimed(store, "o2", "k2")
    assert await put_replies(store, "g", [("rpc", "k1", "o1", BINARY),
                                          ("rpc", "k2", "stale", b"no"),
                                          ("rpc", "k3", "o3", b"no record")]) == [
        True, False, False]
    # not answered while CONSUMING (the handler may still fail)
    assert await get_replies(store, "g", [("rpc", "k1")]) == [None]
    assert await store.complete_many([Ticket("g", "rpc", "k1", "o1"),
                                      Ticket("g", "rpc", "k2", "o2")], RETENTION) == [
        True, True]
    assert await get_replies(store, "g", [("rpc", "k2"), ("rpc", "k1"), ("rpc", "k3")]) == [
        None, BINARY, None]
    assert await get_replies(store, "other", [("rpc", "k1")]) == [None]
    # a consumed record takes no new reply
    assert await put_replies(store, "g", [("rpc", "k1", "o1", b"new")]) == [False]
    clock.advance(RETENTION + 20)  # past retention: as good as absent
    assert await get_replies(store, "g", [("rpc", "k1")]) == [None]


async def test_a_released_claim_retried_writes_its_own_reply(store):
    await claimed(store, "o1", "k")
    assert await put_replies(store, "g", [("rpc", "k", "o1", b"first")]) == [True]
    assert await store.release_many([Ticket("g", "rpc", "k", "o1")]) == [True]
    assert await put_replies(store, "g", [("rpc", "k", "o1", b"late")]) == [False]
    await claimed(store, "o2", "k")
    assert await put_replies(store, "g", [("rpc", "k", "o2", b"second")]) == [True]
    assert await store.complete_many([Ticket("g", "rpc", "k", "o2")], RETENTION) == [True]
    assert await get_replies(store, "g", [("rpc", "k")]) == [b"second"]


@pytest.mark.parametrize("kind", ["sqlite", "mysql", "postgresql"])
async def test_a_table_made_without_the_reply_column_gets_it_and_keeps_working(
        kind, clock, tmp_path, name):
    old = make_store(kind, clock, tmp_path, name)
    conn = old.dialect.connect()  # the table as an older onceq made it: no reply column
    try:
        cur = conn.cursor()
        for stmt in old.dialect.schema(name):
            cur.execute(stmt)
        conn.commit()
    finally:
        conn.close()
    await old.close()
    s = make_store(kind, clock, tmp_path, name)
    try:
        await claimed(s, "o1", "k1")
        assert await put_replies(s, "g", [("rpc", "k1", "o1", b"r")]) == [True]
        assert await s.complete_many([Ticket("g", "rpc", "k1", "o1")], RETENTION) == [True]
        assert await get_replies(s, "g", [("rpc", "k1")]) == [b"r"]
        again = make_store(kind, clock, tmp_path, name)  # the column is there: no change
        assert await get_replies(again, "g", [("rpc", "k1")]) == [b"r"]
        await again.close()
    finally:
        await drop(s)
