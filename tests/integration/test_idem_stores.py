"""One test suite for every dedup store, against the real local servers.

Each test runs on the in-memory reference store, SQLite, Redis, MariaDB and PostgreSQL
(loopback; ``scripts/services.sh`` starts them). A server that is down fails the test with
the service to start: nothing is skipped. Tables and key prefixes are unique per test, and
removed afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sqlite3
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.idempotency import (
    Claim,
    ClaimResult,
    FencingToken,
    Outcome,
    Status,
    Ticket,
    payload_hash,
)
from onceq.idempotency.record import HISTORY_CHARS, events
from onceq.idempotency.store import (
    MemoryStore,
    StoreError,
    claim_keys,
    complete_keys,
    fresh_record,
    open_store,
)
from tests.clock import FakeClock

SERVERS = {
    "redis": (os.environ.get("ONCEQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"), 6379),
    "mysql": (os.environ.get("ONCEQ_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"), 3306),
    "postgresql": (os.environ.get("ONCEQ_TEST_POSTGRES_URL",
                                  "postgresql://postgres@127.0.0.1:5432/test"), 5432),
}
KINDS = ["memory", "sqlite", "redis", "mysql", "postgresql"]
LEASE = 10.0
RETENTION = 3600.0


def require_server(kind: str) -> str:
    url, port = SERVERS[kind]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    except OSError as exc:
        pytest.fail(f"{kind} is not reachable on 127.0.0.1:{port} ({exc}): start it with "
                    f"`bash scripts/services.sh {'mariadb' if kind == 'mysql' else kind}`")
    return url


def make_store(kind: str, clock: FakeClock, tmp_path, name: str):
    if kind == "memory":
        return MemoryStore(clock)
    if kind == "sqlite":
        return open_store(f"sqlite:///{tmp_path}/dedup.db", clock=clock, table=name)
    url = require_server(kind)
    if kind == "redis":
        return open_store(url, clock=clock, prefix=f"onceq:test:{name}:")
    return open_store(url, clock=clock, table=name)


async def drop(store) -> None:
    if hasattr(store, "drop_table"):
        await store.drop_table()
    elif hasattr(store, "drop_all"):
        await store.drop_all()
    await store.close()


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def clock():
    return FakeClock(1_000_000.0)


@pytest.fixture
def name():
    return f"onceq_t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def store(kind, clock, tmp_path, name):
    s = make_store(kind, clock, tmp_path, name)
    yield s
    await drop(s)


def claim(owner: str, key: str = "k1", body: bytes = b"b", group: str = "g", topic: str = "t",
          **kw) -> Claim:
    return Claim(group, topic, key, owner, payload_hash(body), lease_s=kw.pop("lease_s", LEASE),
                 retention_s=kw.pop("retention_s", RETENTION), **kw)


def ticket(owner: str, key: str = "k1") -> Ticket:
    return Ticket("g", "t", key, owner)


async def test_claim_complete_duplicate(store, clock):
    [r] = await store.claim_many([claim("a")])
    assert r.outcome is Outcome.CLAIMED
    rec = await store.get("g", "t", "k1")
    assert (rec.status, rec.owner, rec.attempt) == (Status.CONSUMING, "a", 1)
    assert rec.lease_until == clock() + LEASE
    [busy] = await store.claim_many([claim("b")])
    assert busy.outcome is Outcome.BUSY and busy.record.owner == "a"
    assert (await store.stats()).consuming == 1
    clock.advance(1)
    assert await store.complete_many([ticket("a")], RETENTION) == [True]
    rec = await store.get("g", "t", "k1")
    assert rec.status is Status.CONSUMED and rec.expires_at == clock() + RETENTION
    [dup] = await store.claim_many([claim("c")])
    assert dup.outcome is Outcome.DUPLICATE and dup.record.owner == "a"
    stats = await store.stats()
    assert (stats.consuming, stats.consumed) == (0, 1)


async def test_batch_in_one_call_keeps_order_and_sees_its_own_duplicates(store):
    keys = [f"key-{i:02d}" for i in range(32)]
    claims = [claim(f"o{i}", k) for i, k in enumerate(keys)] + [claim("dup", "key-05")]
    res = await store.claim_many(claims)
    assert [r.outcome for r in res] == [Outcome.CLAIMED] * 32 + [Outcome.BUSY]
    assert [r.record.key for r in res] == [*keys, "key-05"]
    done = await store.complete_many([ticket(f"o{i}", k) for i, k in enumerate(keys[:10])]
                                     + [ticket("nobody", "key-20")], RETENTION)
    assert done == [True] * 10 + [False]
    rel = await store.release_many([ticket(f"o{i}", k) for i, k in enumerate(keys)][8:12])
    assert rel == [False, False, True, True]  # completed ones cannot be released
    again = await store.claim_many([claim("x", "key-09"), claim("y", "key-10")])
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.CLAIMED]


async def test_a_batch_larger_than_one_statement_mixing_new_and_known_keys(store):
    """1,200 keys in one call (more than one VALUES statement; one array per column where
    the database takes arrays), every third known already: each gets its own outcome."""
    keys = [f"big-{i:04d}" for i in range(1200)]
    known = keys[::3]
    await store.claim_many([claim("first", k) for k in known])
    assert await store.complete_many([ticket("first", k) for k in known],
                                     RETENTION) == [True] * len(known)
    res = await store.claim_many([claim(f"o{i}", k) for i, k in enumerate(keys)])
    assert [r.outcome for r in res] == [Outcome.DUPLICATE if i % 3 == 0 else Outcome.CLAIMED
                                        for i in range(1200)]
    fresh = [(i, k) for i, k in enumerate(keys) if i % 3]
    done = await store.complete_many([ticket(f"o{i}", k) for i, k in fresh]
                                     + [ticket("nobody", keys[1])], RETENTION)
    assert done == [True] * len(fresh) + [False]
    assert (await store.get("g", "t", keys[1199])).status is Status.CONSUMED


@pytest.mark.parametrize("kind", ["sqlite", "mysql", "postgresql"])
async def test_values_wider_than_their_column_are_refused_not_cut(store):
    """A SQL store refuses what its columns cannot hold (MariaDB's INSERT IGNORE would
    otherwise cut it to fit): nothing is written."""
    for bad in (claim("o" * 101), claim("a", group="g" * 129),
                Claim("g", "t", "k1", "a", "h" * 65)):
        with pytest.raises(ValueError):
            await store.claim_many([bad])
    assert await store.get("g", "t", "k1") is None


async def test_release_lets_the_redelivery_run(store, clock):
    await store.claim_many([claim("a")])
    clock.advance(1)
    assert await store.release_many([ticket("a")]) == [True]
    rec = await store.get("g", "t", "k1")
    assert (rec.status, rec.owner, rec.lease_until) == (Status.RELEASED, "a", clock())
    assert (await store.stats()).released == 1
    [r] = await store.claim_many([claim("b")])
    assert r.outcome is Outcome.CLAIMED and (r.record.owner, r.record.attempt) == ("b", 2)
    assert await store.complete_many([ticket("a")], RETENTION) == [False]


async def test_history_tells_who_claimed_when_and_what_happened(store, clock):
    """The operator's view of one key: every transition with its time, attempt and owner,
    including the late calls of a stale owner (fenced off)."""
    t0 = clock()
    await store.claim_many([claim("a")])
    clock.advance(1)
    await store.release_many([ticket("a")])  # the handler failed
    clock.advance(1)
    await store.claim_many([claim("b")])  # the redelivery
    clock.advance(LEASE / 3)
    await store.extend_many([ticket("b")], LEASE, RETENTION)
    clock.advance(LEASE + 1)  # b hangs past its lease
    await store.claim_many([claim("c")])
    clock.advance(1)
    assert await store.complete_many([ticket("b")], RETENTION) == [False]  # b is too late
    assert await store.complete_many([ticket("c")], RETENTION) == [True]
    rec = await store.get("g", "t", "k1")
    got = [(round(e.at - t0, 3), e.event, e.attempt, e.owner) for e in events(rec)]
    want = [(0, "claimed", 1, "a"), (1, "released", 1, "a"), (2, "claimed", 2, "b"),
            (2 + LEASE / 3, "extended", 2, "b"), (3 + LEASE / 3 + LEASE, "taken-over", 3, "c"),
            (4 + LEASE / 3 + LEASE, "fenced-off", 3, "b"),
            (4 + LEASE / 3 + LEASE, "completed", 3, "c")]
    assert got == [(round(at, 3), *rest) for at, *rest in want]


async def test_operator_purge_of_records_older_than_a_time(store, clock):
    await store.claim_many([claim("a", "k1"), claim("b", "k2"), claim("c", "k3")])
    await store.complete_many([ticket("a", "k1")], RETENTION)
    clock.advance(100)
    await store.extend_many([ticket("c", "k3")], LEASE, RETENTION)
    assert await store.purge_expired(10, clock() - 50) == 2  # k1 (CONSUMED) and k2
    assert [await store.get("g", "t", k) is None for k in ("k1", "k2", "k3")] == [
        True, True, False]
    assert await store.purge_expired(10, clock() - 50) == 0


async def test_history_is_bounded(store, clock):
    await store.claim_many([claim("a")])
    for _ in range(HISTORY_CHARS // 20):
        clock.advance(1)
        await store.extend_many([ticket("a")], LEASE, RETENTION)
    rec = await store.get("g", "t", "k1")
    assert len(rec.history) == HISTORY_CHARS
    evs = events(rec)
    assert 10 < len(evs) < HISTORY_CHARS // 20 and {e.event for e in evs} == {"extended"}
    assert evs[-1].at == clock()


async def test_fencing_a_stale_owner_learns_it_lost_and_changes_nothing(store, clock):
    await store.claim_many([claim("first")])
    clock.advance(LEASE + 0.5)  # the first handler is slower than its lease, no extension
    [r] = await store.claim_many([claim("second")])
    assert r.outcome is Outcome.TAKEN_OVER
    assert (r.previous.owner, r.previous.attempt) == ("first", 1)
    assert (r.record.owner, r.record.attempt) == ("second", 2)
    before = await store.get("g", "t", "k1")
    assert before == r.record
    clock.advance(0.5)
    assert await store.complete_many([ticket("first")], RETENTION) == [False]
    assert await store.extend_many([ticket("first")], LEASE, RETENTION) == [False]
    assert await store.release_many([ticket("first")]) == [False]
    fenced = await store.get("g", "t", "k1")
    assert [e.event for e in events(fenced)][-3:] == ["fenced-off"] * 3
    assert dataclasses.replace(fenced, history=before.history) == before
    assert await store.complete_many([ticket("second")], RETENTION) == [True]
    after = await store.get("g", "t", "k1")
    assert (after.status, after.owner, after.attempt) == (Status.CONSUMED, "second", 2)


def accounts(path) -> sqlite3.Connection:
    """The downstream system of the fencing tests: an account row whose writes are guarded
    by the fencing token of the message's claim."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL, "
               "fence INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO accounts (id, balance) VALUES ('acc-1', 100)")
    return db


def guarded_write(db: sqlite3.Connection, fence: FencingToken, balance: int) -> int:
    """The conditional write: the rows it changed (0: a newer claim's write came first)."""
    return db.execute("UPDATE accounts SET balance = :balance, fence = :fence WHERE id = :id "
                      "AND fence < :fence",
                      {"balance": balance, "fence": int(fence), "id": "acc-1"}).rowcount


async def test_a_takeover_yields_a_larger_fencing_token_that_refuses_the_stale_write(
        store, clock, tmp_path):
    """An owner paused past its lease is taken over: the new claim's token is strictly
    larger (attempt + 1, same record), as the store keeps it, and a downstream write
    guarded by ``fence < :token`` refuses the paused owner's late write."""
    [first] = await store.claim_many([claim("first")])
    stale = FencingToken.of(first.record)
    assert (stale.key, stale.attempt, stale.owner) == ("k1", 1, "first")
    assert FencingToken.of(await store.get("g", "t", "k1")) == stale
    clock.advance(LEASE + 0.5)  # "first" is paused (SIGSTOP, GC) past its lease
    [second] = await store.claim_many([claim("second")])
    assert second.outcome is Outcome.TAKEN_OVER
    fresh = FencingToken.of(second.record)
    assert FencingToken.of(await store.get("g", "t", "k1")) == fresh
    assert fresh > stale and int(fresh) > int(stale)
    assert (fresh.attempt, fresh.owner, fresh.epoch) == (2, "second", stale.epoch)

    db = accounts(tmp_path / "accounts.db")
    try:
        assert guarded_write(db, fresh, 70) == 1
        assert guarded_write(db, stale, 40) == 0  # "first" resumes: refused
        assert db.execute("SELECT balance, fence FROM accounts").fetchone() == (70, int(fresh))
    finally:
        db.close()
    assert await store.complete_many([ticket("first")], RETENTION) == [False]

    assert await store.release_many([ticket("second")]) == [True]  # its handler failed
    [third] = await store.claim_many([claim("third")])
    assert third.outcome is Outcome.CLAIMED
    assert FencingToken.of(third.record) > fresh and third.record.attempt == 3
    clock.advance(LEASE + 0.5)
    [fourth] = await store.claim_many([claim("fourth")])  # a second takeover
    assert fourth.outcome is Outcome.TAKEN_OVER
    assert FencingToken.of(fourth.record) > FencingToken.of(third.record)
    assert fourth.record.attempt == 4


async def test_a_record_made_again_after_its_retention_gives_a_larger_token(store, clock):
    """A crashed claim past its lease and retention is as good as absent: the next claim
    starts at attempt 1 in a new record, whose later epoch keeps its token larger."""
    [old] = await store.claim_many([claim("a", lease_s=1, retention_s=5)])
    clock.advance(50)
    [new] = await store.claim_many([claim("b")])
    assert new.outcome is Outcome.CLAIMED and new.record.attempt == 1
    assert FencingToken.of(new.record) > FencingToken.of(old.record)
    assert int(FencingToken.of(new.record)) > int(FencingToken.of(old.record))
    assert FencingToken.of(await store.get("g", "t", "k1")) == FencingToken.of(new.record)


async def test_extension_keeps_a_slow_handler_owner(store, clock):
    await store.claim_many([claim("a")])
    for _ in range(6):
        clock.advance(LEASE / 3)
        assert await store.extend_many([ticket("a")], LEASE, RETENTION) == [True]
        [r] = await store.claim_many([claim("b")])
        assert r.outcome is Outcome.BUSY
    rec = await store.get("g", "t", "k1")
    assert rec.lease_until == clock() + LEASE and rec.owner == "a"


async def test_payload_conflict_and_its_switch(store):
    await store.claim_many([claim("a", body=b"order 1: 10 EUR")])
    [r] = await store.claim_many([claim("b", body=b"order 1: 99 EUR")])
    assert r.outcome is Outcome.CONFLICT and r.record.owner == "a"
    [r] = await store.claim_many([claim("b", body=b"order 1: 99 EUR", check_payload=False)])
    assert r.outcome is Outcome.BUSY


async def test_retention_expiry_and_purge(store, clock):
    await store.claim_many([claim("a", "k1"), claim("b", "k2", lease_s=1, retention_s=5)])
    await store.complete_many([ticket("a", "k1")], 100.0)
    clock.advance(50)  # k2: lease ended long ago, retention after the lease too
    assert await store.get("g", "t", "k2") is None
    assert (await store.claim_many([claim("c", "k2")]))[0].outcome is Outcome.CLAIMED
    clock.advance(60)  # k1 past its retention; k2 (retention 3600) still there
    assert await store.get("g", "t", "k1") is None
    purged = await store.purge_expired()
    assert purged in (0, 1)  # Redis may have dropped it by TTL already
    stats = await store.stats()
    assert (stats.consuming, stats.consumed) == (1, 0)
    [r] = await store.claim_many([claim("d", "k1")])
    assert r.outcome is Outcome.CLAIMED and r.record.attempt == 1


async def test_two_consumers_claim_the_same_key_at_the_same_instant_500_times(
        kind, clock, tmp_path, name):
    """Two store clients (separate connections) claim each key at once: exactly one wins,
    the effect happens once, and the loser's redelivery is acknowledged as a duplicate."""
    a = make_store(kind, clock, tmp_path, name)
    b = a if kind == "memory" else make_store(kind, clock, tmp_path, name)
    effects: dict[str, int] = {}
    wins = {"a": 0, "b": 0}

    async def consume(s, who: str, key: str) -> Outcome:
        [r] = await s.claim_many([claim(f"{who}-{key}", key, body=key.encode())])
        if r.runnable:
            effects[key] = effects.get(key, 0) + 1
            wins[who] += 1
            assert await s.complete_many([ticket(f"{who}-{key}", key)], RETENTION) == [True]
        return r.outcome

    try:
        for i in range(500):
            key = f"order-{i}"
            outs = await asyncio.gather(consume(a, "a", key), consume(b, "b", key))
            assert sorted(outs) in ([Outcome.BUSY, Outcome.CLAIMED],
                                    [Outcome.CLAIMED, Outcome.DUPLICATE]), (i, outs)
            assert effects[key] == 1
            [again] = await b.claim_many([claim("late", key, body=key.encode())])
            assert again.outcome is Outcome.DUPLICATE
        assert len(effects) == 500 and set(effects.values()) == {1}
        assert wins["a"] + wins["b"] == 500
    finally:
        if b is not a:
            await b.close()
        await drop(a)


op = st.tuples(st.sampled_from(["claim", "complete", "release", "extend", "wait", "purge"]),
               st.integers(0, 2), st.sampled_from(["k1", "k2"]), st.floats(0, 2 * LEASE),
               st.booleans())


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "memory"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=25))
async def test_store_behaves_like_the_reference_model(kind, tmp_path, ops):
    """Random operation sequences give the same results and records as the pure rules."""
    clock = FakeClock(1_000_000.0)
    real = make_store(kind, clock, tmp_path, f"onceq_m_{uuid.uuid4().hex[:12]}")
    model = MemoryStore(clock)
    serial = 0
    try:
        for what, who, key, dt, other_body in ops:
            owner = f"o{who}"
            if what == "wait":
                clock.advance(dt)
                continue
            if what == "purge":
                await real.purge_expired()
                await model.purge_expired()
                continue
            if what == "claim":
                serial += 1
                c = claim(f"{owner}-{serial}", key, body=b"x" if other_body else b"y",
                          retention_s=3 * LEASE)
                got, want = await real.claim_many([c]), await model.claim_many([c])
            else:
                # the latest token of this owner on this key, else a made-up one
                tok = next((r.owner for r in [await model.get("g", "t", key)]
                            if r is not None and r.owner.startswith(owner + "-")),
                           f"{owner}-none")
                t = [ticket(tok, key)]
                if what == "complete":
                    got, want = (await real.complete_many(t, 3 * LEASE),
                                 await model.complete_many(t, 3 * LEASE))
                elif what == "release":
                    got, want = await real.release_many(t), await model.release_many(t)
                else:
                    got, want = (await real.extend_many(t, LEASE, 3 * LEASE),
                                 await model.extend_many(t, LEASE, 3 * LEASE))
            assert got == want, (what, key)
            for k in ("k1", "k2"):
                assert await real.get("g", "t", k) == await model.get("g", "t", k), k
    finally:
        await drop(real)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "mysql://root@127.0.0.1:1/test",
                                 "postgresql://postgres@127.0.0.1:1/test"])
async def test_an_unreachable_store_raises_a_clear_store_error(url):
    s = open_store(url)
    try:
        with pytest.raises(StoreError, match="dedup store"):
            await s.claim_many([claim("a")])
    finally:
        await s.close()


def test_unknown_scheme_and_bad_table_names_are_refused():
    with pytest.raises(ValueError, match="unknown dedup store URL scheme"):
        open_store("mongodb://x")
    with pytest.raises(ValueError, match="invalid table name"):
        open_store("sqlite://", table="x; DROP TABLE y")


async def test_two_idempotent_listeners_receive_the_same_message_at_once_500_times(
        kind, clock, tmp_path, name):
    """The listener layer over each store: the effect happens exactly once every time; the
    loser is told to consume later (never acknowledged) or sees the finished duplicate."""
    from onceq.client.allocation import MessageQueue
    from onceq.client.push import ConsumeContext
    from onceq.idempotency import idempotent
    from onceq.log.record import MessageExt

    a = make_store(kind, clock, tmp_path, name)
    b = a if kind == "memory" else make_store(kind, clock, tmp_path, name)
    effects: dict[str, int] = {}

    async def handle(msgs, ctx):
        for m in msgs:
            effects[m.unique_key] = effects.get(m.unique_key, 0) + 1

    la, lb = idempotent(handle, store=a), idempotent(handle, store=b)
    mq = MessageQueue("t", 0)
    try:
        for i in range(500):
            copies = [MessageExt("t", 0, i, b"order %d" % i, f"U{i}") for _ in range(2)]
            ctxs = [ConsumeContext(mq, 0, group="g") for _ in range(2)]
            await asyncio.gather(la([copies[0]], ctxs[0]), lb([copies[1]], ctxs[1]))
            assert effects[f"U{i}"] == 1, i
            assert sorted(c.ack_index for c in ctxs) in ([-1, 0], [0, 0]), i
        assert la.stats["busy"] + lb.stats["busy"] + la.stats["duplicate"] \
            + lb.stats["duplicate"] == 500
        assert la.stats["claimed"] + lb.stats["claimed"] == 500
    finally:
        if b is not a:
            await b.close()
        await drop(a)


async def test_a_paused_handler_s_late_write_is_refused_downstream_after_a_takeover(
        kind, clock, tmp_path, name):
    """Two listeners (separate store connections): the first one's handler pauses after
    reading its token, past its lease; the second takes the message over and writes with
    its larger token; the first resumes and its guarded write changes nothing."""
    from onceq.client.allocation import MessageQueue
    from onceq.client.push import ConsumeContext
    from onceq.idempotency import idempotent
    from onceq.log.record import MessageExt

    a = make_store(kind, clock, tmp_path, name)
    b = a if kind == "memory" else make_store(kind, clock, tmp_path, name)
    db = accounts(tmp_path / "accounts.db")
    fences: dict[str, FencingToken] = {}
    writes: list[tuple[str, int]] = []
    paused, resume = asyncio.Event(), asyncio.Event()

    def handler(who: str, balance: int):
        async def handle(msgs, ctx):
            fences[who] = ctx.fence
            if who == "paused":
                paused.set()
                await resume.wait()
            writes.append((who, guarded_write(db, ctx.fence, balance)))
        return handle

    la = idempotent(handler("paused", 40), store=a, lease_s=LEASE, extend_leases=False)
    lb = idempotent(handler("taker", 70), store=b, lease_s=LEASE, extend_leases=False)
    mq = MessageQueue("t", 0)
    ca, cb = ConsumeContext(mq, 0, group="g"), ConsumeContext(mq, 0, group="g")
    try:
        first = asyncio.create_task(la([MessageExt("t", 0, 1, b"debit 30", "U1")], ca))
        await paused.wait()
        clock.advance(LEASE + 1)
        await lb([MessageExt("t", 0, 1, b"debit 30", "U1")], cb)  # the redelivered copy
        resume.set()
        await first
        balance = db.execute("SELECT balance, fence FROM accounts").fetchone()
    finally:
        resume.set()
        db.close()
        if b is not a:
            await b.close()
        await drop(a)
    assert fences["taker"] > fences["paused"]
    assert (fences["paused"].attempt, fences["taker"].attempt) == (1, 2)
    assert writes == [("taker", 1), ("paused", 0)]
    assert balance == (70, int(fences["taker"]))
    assert (lb.stats["taken_over"], la.stats["fenced"]) == (1, 1)
    assert cb.ack_index == 0


async def test_store_urls(tmp_path, monkeypatch):
    from onceq.idempotency.sql import SqlStore

    monkeypatch.chdir(tmp_path)
    rel = open_store("sqlite:///rel.db?table=onceq_rel")
    absolute = open_store(f"sqlite:///{tmp_path}/abs.db?synchronous=NORMAL")
    mem = open_store("sqlite://")
    try:
        for s in (rel, absolute, mem):
            assert isinstance(s, SqlStore)
            [r] = await s.claim_many([claim("a")])
            assert r.outcome is Outcome.CLAIMED
        assert rel.table == "onceq_rel"
        assert (tmp_path / "rel.db").exists() and (tmp_path / "abs.db").exists()
    finally:
        for s in (rel, absolute, mem):
            await s.close()
    with pytest.raises(ValueError, match="synchronous"):
        open_store("sqlite://?synchronous=OFF")
    assert isinstance(open_store("memory://"), MemoryStore)


async def test_concurrent_batches_grouped_in_one_commit_keep_their_own_results(store):
    """Many listener batches at once (the SQL stores commit them together): each gets the
    answer it would get alone, in order, including its own in-batch duplicates."""
    async def batch(i: int):
        keys = [f"b{i}-{j}" for j in range(4)] + ["shared"]
        return await store.claim_many([claim(f"o{i}-{k}", k) for k in keys])

    results = await asyncio.gather(*(batch(i) for i in range(60)))
    for res in results:
        assert [r.outcome for r in res[:4]] == [Outcome.CLAIMED] * 4
    shared = [res[4].outcome for res in results]
    assert shared.count(Outcome.CLAIMED) == 1 and shared.count(Outcome.BUSY) == 59
    assert (await store.stats()).consuming == 60 * 4 + 1


async def test_a_failing_operation_does_not_fail_the_others_grouped_with_it(clock, tmp_path,
                                                                           name):
    s = make_store("postgresql", clock, tmp_path, name)
    try:
        await s.claim_many([claim("warm", "warm")])  # the table exists
        bad = s.claim_many([claim("x", "nul\x00key")])  # PostgreSQL refuses NUL in text
        good = [s.claim_many([claim(f"o{i}", f"k{i}")]) for i in range(20)]
        out = await asyncio.gather(bad, *good, return_exceptions=True)
        assert isinstance(out[0], StoreError)
        assert all(r[0].outcome is Outcome.CLAIMED for r in out[1:])
    finally:
        await drop(s)


async def fast_claim(store, owner_keys, body: bytes = b"b", lease_s: float = LEASE,
                     check: bool = True) -> list[ClaimResult]:
    """``claim_keys`` (the listener's path), every result spelled out as ``claim_many``
    gives them: a claim missing from the answer got the fresh record of its tuple."""
    items = [("t", k, o, payload_hash(body)) for o, k in owner_keys]
    now, odd = await claim_keys(store, "g", items, lease_s, RETENTION, check)
    return [odd[j] if j in odd else ClaimResult(
        Outcome.CLAIMED, fresh_record("g", now, lease_s, RETENTION, item))
        for j, item in enumerate(items)]


async def fast_complete(store, owner_keys) -> list[bool]:
    return await complete_keys(store, "g", [("t", k, o, "") for o, k in owner_keys], RETENTION)


async def test_the_listener_path_answers_what_the_rules_say(store, clock):
    """Claims as tuples and completions riding with them (``claim_keys``,
    ``complete_keys``) give the results of ``decide_claim`` and ``decide_complete``; the
    record of a fresh claim, built from its tuple, is the one stored."""
    res = await fast_claim(store, [("o1", "a"), ("o2", "b"), ("o3", "c")])
    assert [r.outcome for r in res] == [Outcome.CLAIMED] * 3
    assert await store.get("g", "t", "a") == res[0].record
    assert res[0].record.status is Status.CONSUMING and res[0].record.attempt == 1
    assert await fast_complete(store, [("o1", "a"), ("stale", "b")]) == [True, False]
    assert [e.event for e in events(await store.get("g", "t", "b"))] == [
        "claimed", "fenced-off"]
    assert await store.release_many([ticket("o3", "c")]) == [True]
    clock.advance(1)
    # known keys mixed with a fresh one, in one batch
    res = await fast_claim(store, [("p1", "a"), ("p2", "b"), ("p3", "c"), ("p4", "d"),
                                   ("p5", "a")])
    assert [r.outcome for r in res] == [Outcome.DUPLICATE, Outcome.BUSY, Outcome.CLAIMED,
                                        Outcome.CLAIMED, Outcome.DUPLICATE]
    assert (res[2].record.owner, res[2].record.attempt) == ("p3", 2)
    assert await store.get("g", "t", "d") == res[3].record
    assert [r.outcome for r in await fast_claim(store, [("x", "a")], body=b"other")] == [
        Outcome.CONFLICT]
    assert [r.outcome for r in await fast_claim(store, [("x", "a")], body=b"other",
                                                check=False)] == [Outcome.DUPLICATE]
    clock.advance(LEASE + 1)  # o2's lease on b is over
    [taken] = await fast_claim(store, [("q2", "b")])
    assert taken.outcome is Outcome.TAKEN_OVER and taken.previous.owner == "o2"
    assert await fast_complete(store, [("o2", "b"), ("q2", "b"), ("p3", "c")]) == [
        False, True, True]
    assert await fast_complete(store, [("q2", "b")]) == [True]  # again by its owner: won
    rec = await store.get("g", "t", "b")
    assert (rec.status, rec.owner, rec.attempt) == (Status.CONSUMED, "q2", 2)


async def test_completions_and_claims_waiting_together_keep_their_own_answers(store):
    """Completions of finished batches go in one store call with the claims waiting at the
    same time (one transaction, one script call): each caller gets its own answer."""
    first = [(f"o{i}", f"k{i}") for i in range(40)]
    await fast_claim(store, first)
    done = [fast_complete(store, first[i:i + 10]) for i in range(0, 40, 10)]
    copies = [fast_claim(store, [(f"c{i}", f"k{i}")]) for i in range(40)]
    fresh = [fast_claim(store, [(f"f{i}-{j}", f"n{i}-{j}") for j in range(8)])
             for i in range(10)]
    out = await asyncio.gather(*done, *copies, *fresh)
    assert all(all(won) for won in out[:4])
    assert {r[0].outcome for r in out[4:44]} <= {Outcome.DUPLICATE, Outcome.BUSY}
    assert all(r.outcome is Outcome.CLAIMED and r.record.attempt == 1
               for res in out[44:] for r in res)
    for o, k in first:
        rec = await store.get("g", "t", k)
        assert (rec.status, rec.owner) == (Status.CONSUMED, o)
    stats = await store.stats()
    assert (stats.consumed, stats.consuming) == (40, 80)


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
async def test_a_server_refusing_the_one_trip_call_gets_transactions(server, clock, tmp_path,
                                                                     name, monkeypatch):
    """PostgreSQL and MariaDB take a group of completions and claims in one round trip;
    when the server refuses that call (an older server without JSON_TABLE, say), each
    group runs in a transaction instead, with the same answers, and after a few refusals
    in a row the store stops trying."""
    from onceq.idempotency import sql

    monkeypatch.setattr(sql, "_PG_ONE_TRIP", "SELECT no_such_function()")
    monkeypatch.setattr(sql, "_MYSQL_ONE_TRIP", "SELECT no_such_function()")
    s = make_store(server, clock, tmp_path, name)
    try:
        for i in range(sql._ONE_TRIP_TRIES + 2):
            res = await fast_claim(s, [(f"o{i}", f"k{i}"), ("x", "k0")])
            # k0 twice in the first batch: its copy waits; later, a duplicate
            assert [r.outcome for r in res] == [
                Outcome.CLAIMED, Outcome.BUSY if i == 0 else Outcome.DUPLICATE]
            assert await fast_complete(s, [(f"o{i}", f"k{i}"), ("x", f"k{i}")]) == [
                True, False]
        assert s._one_trip_failures == sql._ONE_TRIP_TRIES
        assert (await s.get("g", "t", "k3")).status is Status.CONSUMED
    finally:
        await drop(s)
