"""Orderly consumption over loopback: the broker's queue locks (request by request), the
producer's selector, the orderly consumer's suspend / retry / DLQ paths, broadcasting."""

from __future__ import annotations

import time

import pytest

from onceq import Admin, OnceqError, Producer
from onceq.client.allocation import MessageQueue
from onceq.client.connection import BrokerConnection
from onceq.client.consume import ConsumeStatus, orderly
from onceq.client.push import PushConsumer
from onceq.protocol.codes import PullStatus, RequestCode, dlq_topic
from onceq.protocol.errors import ErrorCode
from tests.helpers import wait_until

G = "og"
T = "OT"


async def _member(addr: str, client: str, *, orderly_meta: bool = True) -> BrokerConnection:
    conn = await BrokerConnection.open(addr)
    meta = {"orderly": True} if orderly_meta else {}
    await conn.request(RequestCode.HEARTBEAT, {"client": client, "groups": [
        {"group": G, "model": "CLUSTERING", "subs": {T: "*"}, "meta": meta}]})
    return conn


async def _lock(conn: BrokerConnection, client: str, queues: list[int]) -> list[int]:
    hdr, _ = await conn.request(RequestCode.LOCK_QUEUES, {
        "group": G, "client": client, "queues": [[T, q] for q in queues]})
    return [q for _t, q in hdr["locked"]]


async def _unlock(conn: BrokerConnection, client: str, items: list[tuple[int, int]]
                  ) -> list[int]:
    hdr, _ = await conn.request(RequestCode.UNLOCK_QUEUES, {
        "group": G, "client": client, "queues": [[T, q, off] for q, off in items]})
    return [q for _t, q in hdr["unlocked"]]


async def _pull(conn: BrokerConnection, client: str, queue: int = 0) -> dict:
    hdr, _ = await conn.request(RequestCode.PULL, {"topic": T, "queue": queue, "offset": 0,
                                                   "max": 32, "group": G, "client": client})
    return hdr


@pytest.fixture
async def topic(addr):
    async with Admin(addr) as admin:
        await admin.create_topic(T, 4)
    async with Producer(addr) as p:
        for q in range(4):
            await p.send_batch(T, [b"m%d" % i for i in range(5)], queue=q)
    return T


# ================================================================ broker: queue locks
async def test_lock_unlock_holder_only_and_commit_then_release(broker, addr, topic):
    a = await _member(addr, "a")
    b = await _member(addr, "b")
    try:
        assert await _lock(a, "a", [0, 1]) == [0, 1]
        assert await _lock(b, "b", [0, 1, 2, 3]) == [2, 3]  # the batch answer: held now
        # only the holder pulls and commits
        assert (await _pull(b, "b", 0))["st"] == PullStatus.LOCKED
        assert (await _pull(a, "a", 0))["st"] == PullStatus.FOUND
        with pytest.raises(OnceqError) as err:
            await a.request(RequestCode.COMMIT_OFFSET, {"group": G, "topic": T, "queue": 2,
                                                        "offset": 3, "client": "a"})
        assert err.value.code == ErrorCode.NOT_HOLDER
        # unlock by a non-holder: nothing released, nothing committed
        assert await _unlock(b, "b", [(0, 4)]) == []
        assert broker.store.get_offset(G, T, 0) == -1
        # the holder's unlock commits, then releases: the next holder starts there
        assert await _unlock(a, "a", [(0, 4), (1, -1)]) == [0, 1]
        assert broker.store.get_offset(G, T, 0) == 4
        assert broker.store.get_offset(G, T, 1) == -1  # -1: release without a commit
        assert await _lock(b, "b", [0, 1]) == [0, 1]
        rows = {r["queue"]: r for r in broker.owners.orderly_status(G)}
        assert {q: r["holder"] for q, r in rows.items()} == {0: "b", 1: "b", 2: "b", 3: "b"}
    finally:
        a.close()
        b.close()


async def test_locks_go_when_the_member_disconnects_or_unregisters(broker, addr, topic):
    a = await _member(addr, "a")
    b = await _member(addr, "b")
    try:
        assert await _lock(a, "a", [0, 1]) == [0, 1]
        a.close()  # a crash: no unlock; the new owner does not wait for the 60 s expiry
        await wait_until(lambda: broker.groups.member(G, "a") is None, 5, "a to leave")
        assert await _lock(b, "b", [0, 1]) == [0, 1]
        await b.request(RequestCode.UNREGISTER, {"group": G, "client": "b"})
        assert broker.owners.orderly_status(G) == []
    finally:
        b.close()


async def test_lock_needs_membership_and_refuses_bad_input(addr, topic):
    conn = await BrokerConnection.open(addr)
    try:
        with pytest.raises(OnceqError) as err:
            await conn.request(RequestCode.LOCK_QUEUES, {"group": G, "client": "x",
                                                         "queues": [[T, 0]]})
        assert err.value.code == ErrorCode.NOT_MEMBER
        await conn.request(RequestCode.HEARTBEAT, {"client": "x", "groups": [
            {"group": G, "model": "CLUSTERING", "subs": {T: "*"}, "meta": {"orderly": True}}]})
        for bad in ([[T]], [[T, "0"]], [[T, True]], "x", [[1, 0]], [[T, 0, 1]]):
            with pytest.raises(OnceqError) as err:
                await conn.request(RequestCode.LOCK_QUEUES, {"group": G, "client": "x",
                                                             "queues": bad})
            assert err.value.code == ErrorCode.INVALID_ARGUMENT, bad
        with pytest.raises(OnceqError) as err:
            await conn.request(RequestCode.UNLOCK_QUEUES, {"group": G, "client": "x",
                                                           "queues": [[T, 0]]})
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        # unknown topics and queue ids are not granted; the rest of the batch is
        assert await _lock(conn, "x", [0, 99]) == [0]
        hdr, _ = await conn.request(RequestCode.LOCK_QUEUES, {
            "group": G, "client": "x", "queues": [["nope", 0], [T, 1]]})
        assert hdr["locked"] == [[T, 1]]  # of the queues asked for
    finally:
        conn.close()


async def test_one_holder_across_the_access_lock_and_the_orderly_lock(broker, addr, topic):
    """A concurrent member (access lock) and an orderly member never hold one queue."""
    c = await _member(addr, "conc", orderly_meta=False)
    o = await _member(addr, "ord")
    try:
        assert (await _pull(c, "conc", 0))["st"] == PullStatus.FOUND  # access lock taken
        assert broker.owners.holder(G, T, 0) == "conc"
        assert await _lock(o, "ord", [0, 1]) == [1]  # queue 0: held by the access lock
        assert (await _pull(c, "conc", 1))["st"] == PullStatus.LOCKED  # orderly-held
        assert broker.owners.holder(G, T, 1) is None
        await c.request(RequestCode.RELEASE_QUEUE, {"group": G, "client": "conc",
                                                   "topic": T, "queue": 0, "offset": 5})
        assert await _lock(o, "ord", [0]) == [0]
    finally:
        c.close()
        o.close()


# ================================================================ producer selector
async def test_selector_picks_the_queue_and_a_bad_one_is_refused(addr, topic):
    async with Producer(addr) as p:
        r = await p.send(T, b"x", selector=lambda n, m: n - 1)
        assert r.queue_id == 3
        rs = await p.send_batch(T, [b"k7 1", b"k7 2"], selector=lambda n, m: len(m.body) % n)
        assert {x.queue_id for x in rs} == {0}
        with pytest.raises(ValueError, match="selector returned 4"):
            await p.send(T, b"x", selector=lambda n, m: n)


# ================================================================ orderly consumer
def _consumer(addr: str, listener, **kw) -> PushConsumer:
    kw.setdefault("consume_from", "FIRST")
    kw.setdefault("rebalance_interval_s", 1.0)
    c = PushConsumer(addr, G, listener, **kw)
    c.subscribe(T)
    return c


async def test_suspend_retries_the_same_messages_in_place(broker, addr, topic):
    calls: list[tuple[int, int, int, float]] = []

    @orderly
    async def listener(msgs, ctx):
        calls.append((ctx.queue.queue_id, msgs[0].queue_offset, ctx.attempt, time.monotonic()))
        if ctx.queue.queue_id == 0 and msgs[0].queue_offset == 2 and ctx.attempt < 3:
            ctx.suspend_ms = 50
            return ConsumeStatus.SUSPEND
        if ctx.queue.queue_id == 1 and msgs[0].queue_offset == 1 and ctx.attempt < 2:
            raise RuntimeError("fails once")  # an exception suspends too (1 s default)
        return ConsumeStatus.SUCCESS

    c = _consumer(addr, listener, suspend_s=0.2)
    await c.start()
    try:
        await wait_until(lambda: len({(q, o) for q, o, _, _ in calls}) == 20, 15, "all")
        q0 = [(o, a) for q, o, a, _ in calls if q == 0]
        assert q0 == [(0, 1), (1, 1), (2, 1), (2, 2), (2, 3), (3, 1), (4, 1)]
        q1 = [(o, a, t) for q, o, a, t in calls if q == 1]
        assert [(o, a) for o, a, _ in q1] == [(0, 1), (1, 1), (1, 2), (2, 1), (3, 1), (4, 1)]
        assert q1[2][2] - q1[1][2] >= 0.19  # the suspend time of the setting
        assert c.stats["suspended"] == 3
    finally:
        await c.shutdown()
    # the offsets were committed then unlocked at shutdown; nothing is locked any more
    assert [broker.store.get_offset(G, T, q) for q in range(4)] == [5, 5, 5, 5]
    assert broker.owners.orderly_status(G) == []


async def test_partial_success_consumes_the_acknowledged_prefix_and_retries_the_rest(
        broker, addr, topic):
    """SUCCESS with an ack_index inside the batch (what the idempotency layer answers when
    a claim is held elsewhere): the messages up to it are done, the rest are retried in
    place, in order, none lost and none handled twice."""
    done: list[tuple[int, int]] = []
    calls: list[tuple[int, list[int]]] = []

    @orderly
    async def listener(msgs, ctx):
        q = ctx.queue.queue_id
        calls.append((q, [m.queue_offset for m in msgs]))
        if q == 0 and len(msgs) > 1 and msgs[0].queue_offset == 0:
            done.append((q, msgs[0].queue_offset))
            ctx.ack_index = 0  # only the first one now
            ctx.suspend_ms = 10
            return ConsumeStatus.SUCCESS
        done.extend((q, m.queue_offset) for m in msgs)
        return ConsumeStatus.SUCCESS

    c = _consumer(addr, listener, batch_size=3)
    await c.start()
    try:
        await wait_until(lambda: len(done) == 20, 15, "all")
        assert sorted(done) == [(q, o) for q in range(4) for o in range(5)]  # each once
        assert [o for q, o in done if q == 0] == [0, 1, 2, 3, 4]  # in order
        assert [offs for q, offs in calls if q == 0][:2] == [[0, 1, 2], [1, 2]]
    finally:
        await c.shutdown()
    assert [broker.store.get_offset(G, T, q) for q in range(4)] == [5, 5, 5, 5]


async def test_max_retries_sends_the_messages_to_the_dlq_and_moves_on(broker, addr, topic):
    handled: list[tuple[int, int]] = []

    @orderly
    async def listener(msgs, ctx):
        if ctx.queue.queue_id == 2 and msgs[0].queue_offset == 1:
            ctx.suspend_ms = 10
            return ConsumeStatus.SUSPEND
        handled.extend((ctx.queue.queue_id, m.queue_offset) for m in msgs)
        return None

    c = _consumer(addr, listener, orderly_max_retries=2)
    await c.start()
    try:
        await wait_until(lambda: len(handled) == 19, 15, "the other messages")
        assert [o for q, o in handled if q == 2] == [0, 2, 3, 4]
        assert c.stats["dlq"] == 1 and c.stats["suspended"] == 3
    finally:
        await c.shutdown()
    async with Admin(addr) as admin:
        letters = await admin.dead_letters(G)
    assert [m.body for m in letters] == [b"m1"]
    assert dlq_topic(G) in broker.store.topics


async def test_orderly_setting_without_a_marked_listener(broker, addr, topic):
    seen: list[tuple[int, int]] = []
    c = _consumer(addr, lambda msgs, ctx: seen.extend(
        (ctx.queue.queue_id, m.queue_offset) for m in msgs), orderly=True, batch_size=2)
    await c.start()
    try:
        await wait_until(lambda: len(seen) == 20, 10, "all")
        assert c.orderly
        for q in range(4):
            assert [o for qq, o in seen if qq == q] == [0, 1, 2, 3, 4]
        assert {r["holder"] for r in broker.owners.orderly_status(G)} == {c.client_id}
    finally:
        await c.shutdown()


async def test_broadcasting_orderly_takes_no_lock_and_keeps_local_order(broker, addr, topic,
                                                                         tmp_path):
    seen: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}

    def listener(name):
        @orderly
        async def fn(msgs, ctx):
            seen[name].extend((ctx.queue.queue_id, m.queue_offset) for m in msgs)
        return fn

    cs = [_consumer(addr, listener(n), model="BROADCASTING", client_id=n,
                    offset_dir=str(tmp_path / n)) for n in "ab"]
    for c in cs:
        await c.start()
    try:
        await wait_until(lambda: all(len(v) == 20 for v in seen.values()), 10, "both")
        for v in seen.values():
            for q in range(4):
                assert [o for qq, o in v if qq == q] == [0, 1, 2, 3, 4]
        assert broker.owners.orderly_status(G) == []
        assert sorted(cs[0].assignment) == [MessageQueue(T, q) for q in range(4)]
    finally:
        for c in cs:
            await c.shutdown()


async def test_a_lost_lock_stops_the_queue_until_it_is_locked_again(broker, addr, topic):
    """The broker gave the queue to another client (as after an expiry): the renewal is
    refused, the consumer stops that queue, and takes it again fresh once it is free."""
    seen: list[tuple[int, int]] = []

    @orderly
    async def listener(msgs, ctx):
        seen.extend((ctx.queue.queue_id, m.queue_offset) for m in msgs)

    c = _consumer(addr, listener, lock_renew_s=0.2, lock_max_age_s=0.5, lock_retry_s=0.1,
                  commit_interval_s=0.1)
    await c.start()
    intruder = None
    try:
        await wait_until(lambda: len(seen) == 20, 10, "all")
        # a second member (it never consumes): the group splits the queues, the consumer
        # keeps queues 0 and 1 (its id sorts first)
        intruder = await _member(addr, "zz-intruder")
        await wait_until(lambda: [mq.queue_id for mq in c.assignment if mq.topic == T]
                         == [0, 1], 10, "the rebalance")
        await wait_until(lambda: broker.store.get_offset(G, T, 0) == 5, 5, "commit")
        broker.owners.core.orderly.release_client(c.client_id, G)
        assert await _lock(intruder, "zz-intruder", [0]) == [0]
        await wait_until(lambda: c.stats["lock_lost"] >= 1, 5, "the renewal refused")
        async with Producer(addr) as p:
            await p.send_batch(T, [b"n1", b"n2"], queue=0)
        refused = c.stats["lock_refused"]
        await wait_until(lambda: c.stats["lock_refused"] >= refused + 3, 5,
                         "relocks refused while the messages wait")
        assert len(seen) == 20  # not consumed while another client holds the lock
        assert await _unlock(intruder, "zz-intruder", [(0, -1)]) == [0]
        await wait_until(lambda: len(seen) == 22, 10, "the queue taken again")
        assert seen[20:] == [(0, 5), (0, 6)]  # from the group's offset, nothing repeated
    finally:
        if intruder is not None:
            intruder.close()
        await c.shutdown()


async def test_relocks_at_once_after_the_broker_lost_its_locks(broker, addr, topic):
    @orderly
    async def listener(msgs, ctx):
        pass

    c = _consumer(addr, listener)
    await c.start()
    try:
        await wait_until(lambda: len(broker.owners.orderly_status(G)) == 4, 10, "locks")  # OT:0-3
        broker.owners.core.orderly.release_client(c.client_id)  # as a restarted broker
        c._conn.close()  # the connection drops; the consumer reconnects
        await wait_until(lambda: len(broker.owners.orderly_status(G)) == 4, 10, "relocked")
        assert c.stats["lock_lost"] == 0
    finally:
        await c.shutdown()
