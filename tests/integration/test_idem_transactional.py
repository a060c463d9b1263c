"""Transactional exactly-once on SQLite, MariaDB and PostgreSQL: the dedup row and the
business writes commit together; duplicates, handler failures, races and SIGKILLed
consumers leave exactly one effect per message."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from onceq import Admin, Producer
from onceq.client.allocation import MessageQueue
from onceq.client.push import ConsumeContext, ConsumeStatus, PushConsumer
from onceq.idempotency import WriteLockTimeout, transactional
from onceq.log.record import MessageExt
from tests.integration.test_idem_consumer import start_child
from tests.integration.test_idem_stores import require_server
from tests.integration.test_push_consumer import wait_until

KINDS = ["sqlite", "mysql", "postgresql"]
MQ = MessageQueue("orders", 0)


class Db:
    """The business side: an effects table (no unique key: duplicates would show)."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.url = (f"sqlite:///{tmp_path}/shop.db" if kind == "sqlite"
                    else require_server(kind))
        self.mark = "?" if kind == "sqlite" else "%s"
        uid = uuid.uuid4().hex[:10]
        self.effects = f"eff_{uid}"
        self.table = f"onceq_done_{uid}"

    def connect(self):
        from onceq.idempotency.transactional import _dialect

        return _dialect(self.url).connect()

    def sql(self, stmt: str, args: tuple = ()) -> list[tuple]:
        conn = self.connect()
        try:
            cur = conn.cursor()
            cur.execute(stmt, args)
            rows = list(cur.fetchall()) if cur.description else []
            conn.commit()
            return rows
        finally:
            conn.close()

    def create(self) -> None:
        self.sql(f"CREATE TABLE {self.effects} (k VARCHAR(64) NOT NULL, pid INTEGER)")

    def counts(self) -> dict[str, int]:
        return dict(self.sql(f"SELECT k, COUNT(*) FROM {self.effects} GROUP BY k"))

    def drop(self) -> None:
        for t in (self.effects, self.table):
            self.sql(f"DROP TABLE IF EXISTS {t}")

    def handler(self, fail_on: set[str] | None = None):
        def handle(m: MessageExt, conn) -> None:
            conn.cursor().execute(f"INSERT INTO {self.effects} (k, pid) VALUES "
                                  f"({self.mark}, 0)", (m.unique_key,))
            if fail_on and m.unique_key in fail_on:
                raise RuntimeError("stock service refused")  # after a write: rolled back
        return handle


@pytest.fixture(params=KINDS)
def db(request, tmp_path):
    d = Db(request.param, tmp_path)
    d.create()
    yield d
    d.drop()


def msgs(*ids: int) -> list[MessageExt]:
    return [MessageExt("orders", 0, i, f"order {i}".encode(), f"U{i}") for i in ids]


async def call(listener, batch):
    ctx = ConsumeContext(MQ, len(batch) - 1, group="billing")
    status = await listener(batch, ctx)
    return status, ctx.ack_index, ctx.delay_level


async def test_batch_commits_rows_and_effects_together_and_duplicates_do_nothing(db):
    lst = transactional(db.handler(), db=db.url, table=db.table)
    try:
        assert await call(lst, msgs(0, 1, 2, 3, 4)) == (ConsumeStatus.SUCCESS, 4, 0)
        assert await call(lst, msgs(0, 1, 2, 3, 4, 0)) == (ConsumeStatus.SUCCESS, 5, 0)
        assert db.counts() == {f"U{i}": 1 for i in range(5)}
        assert lst.stats["handled"] == 5 and lst.stats["duplicate"] == 6
    finally:
        await lst.close()


async def test_handler_failure_rolls_back_its_writes_and_retries_from_there(db):
    lst = transactional(db.handler(fail_on={"U2"}), db=db.url, table=db.table)
    try:
        assert await call(lst, msgs(0, 1, 2, 3, 4)) == (ConsumeStatus.SUCCESS, 1, 0)
        assert db.counts() == {"U0": 1, "U1": 1}  # U2's write vanished with its savepoint
        lst.handler = db.handler()
        assert await call(lst, msgs(2, 3, 4)) == (ConsumeStatus.SUCCESS, 2, 0)
        assert db.counts() == {f"U{i}": 1 for i in range(5)}
    finally:
        await lst.close()


async def test_same_key_other_payload_goes_to_the_dlq(db):
    lst = transactional(db.handler(), db=db.url, table=db.table)
    try:
        await call(lst, msgs(1))
        other = [MessageExt("orders", 0, 9, b"order 1, amount changed", "U1")]
        assert await call(lst, other) == (ConsumeStatus.SUCCESS, -1, -1)
        assert db.counts() == {"U1": 1}
    finally:
        await lst.close()


async def test_two_consumers_get_the_same_message_at_once_200_times(db):
    a = transactional(db.handler(), db=db.url, table=db.table)
    b = transactional(db.handler(), db=db.url, table=db.table)
    try:
        for i in range(200):
            results = await asyncio.gather(call(a, msgs(i)), call(b, msgs(i)))
            assert all(r == (ConsumeStatus.SUCCESS, 0, 0) for r in results), (i, results)
        counts = db.counts()
        assert len(counts) == 200 and set(counts.values()) == {1}
        assert a.stats["handled"] + b.stats["handled"] == 200
        assert a.stats["duplicate"] + b.stats["duplicate"] == 200
    finally:
        await a.close()
        await b.close()


async def test_concurrent_batches_share_a_commit_and_a_failed_group_is_run_again_apart(db):
    """Group commit: batches arriving while the database is busy run in one transaction.
    When that transaction fails (a database error, injected once into one batch), nothing
    of it is committed and each batch runs again alone: one effect per message."""
    ran: list[str] = []
    handle = db.handler(fail_on={"U7"})

    def counted(m, conn):
        ran.append(m.unique_key)
        handle(m, conn)

    lst = transactional(counted, db=db.url, table=db.table)
    commits = 0
    tx, batch_tx = lst.engine._tx, lst._batch_tx
    injected = False

    def counting_tx(*a):
        nonlocal commits
        out = tx(*a)
        commits += 1
        return out

    def failing_once(cur, now, group, items):
        nonlocal injected
        out = batch_tx(cur, now, group, items)
        if items[0][0].unique_key == "U50" and not injected:
            injected = True
            raise RuntimeError("deadlock detected (injected)")  # after the handler ran
        return out

    lst.engine._tx = counting_tx
    lst._batch_tx = failing_once
    try:
        await call(lst, msgs(3))  # done before: a duplicate in the burst below
        results = await asyncio.gather(*(call(lst, msgs(i)) for i in range(40)))
        assert results[7] == (ConsumeStatus.SUCCESS, -1, 0)  # its handler failed: retried
        assert all(r == (ConsumeStatus.SUCCESS, 0, 0) for i, r in enumerate(results)
                   if i != 7)
        assert commits <= 1 + 40 // 2  # 40 batches in at most half as many commits
        assert db.counts() == {f"U{i}": 1 for i in range(40) if i != 7}

        results = await asyncio.gather(*(call(lst, msgs(i)) for i in range(40, 60)))
        assert injected and all(r == (ConsumeStatus.SUCCESS, 0, 0) for r in results)
        assert db.counts() == {f"U{i}": 1 for i in range(60) if i != 7}
        assert ran.count("U50") == 2  # its group was rolled back, then it ran alone
        assert (lst.stats["handled"], lst.stats["duplicate"], lst.stats["failed"]) == (59, 1, 1)
    finally:
        await lst.close()


# a member of the group that takes SQLite's write lock, says so, and waits to be told to
# commit: stopped with SIGSTOP meanwhile, it is a member paused inside its transaction
HOLDER = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute(f"INSERT INTO {sys.argv[2]} (k, pid) VALUES ('held', 1)")
print("holding", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def trace_begins(lst) -> list[str]:
    """The ``BEGIN`` statements the listener's SQLite connections start from now on (each
    one waits for the write lock once)."""
    begins: list[str] = []
    connect = lst.engine.dialect.connect

    def traced():
        conn = connect()
        conn.set_trace_callback(lambda stmt: begins.append(stmt) if stmt.startswith("BEGIN")
                                else None)
        return conn

    lst.engine.dialect.connect = traced
    return begins


async def test_sqlite_a_member_stopped_in_its_transaction_stalls_a_batch_for_the_busy_timeout(
        tmp_path, caplog):
    """Another process takes the write lock and is stopped (SIGSTOP) inside its
    transaction: the batch fails after the busy timeout with the retriable error and one
    log line naming the database, the wait and the likely cause; it is consumed later (not
    acknowledged, not sent to the DLQ, not a handler failure) and runs once the stopped
    member has resumed and committed."""
    db = Db("sqlite", tmp_path)
    db.create()
    path = str(tmp_path / "shop.db")
    lst = transactional(db.handler(), db=db.url, table=db.table, busy_timeout_s=0.2)
    begins = trace_begins(lst)
    holder = None
    try:
        assert await call(lst, msgs(0)) == (ConsumeStatus.SUCCESS, 0, 0)  # table, WAL
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, path, db.effects],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "holding\n"
        os.kill(holder.pid, signal.SIGSTOP)
        ctx = ConsumeContext(MQ, 1, group="billing")
        with caplog.at_level(logging.WARNING, logger="onceq.idempotency"):
            before = len(begins)
            started = time.monotonic()
            status = await lst(msgs(1, 2), ctx)
            waited = time.monotonic() - started
            attempts = len(begins) - before
        os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.write("commit\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        again = await call(lst, msgs(1, 2))
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        await lst.close()
    counts = db.counts()
    db.drop()
    assert status == ConsumeStatus.RECONSUME_LATER
    assert (ctx.delay_level, ctx.dlq_reasons) == (0, {})  # a normal retry, no DLQ verdict
    assert attempts == 1  # one wait for the lock, not retried at once
    assert 0.2 <= waited < 5.0
    assert (lst.stats["lock_timeouts"], lst.stats["store_errors"], lst.stats["failed"]) == (
        1, 1, 0)
    lines = [r.getMessage() for r in caplog.records if "write lock" in r.getMessage()]
    assert len(lines) == 1
    assert f"sqlite database {path}:" in lines[0]
    assert "busy timeout 0.2 s" in lines[0]
    assert 0.2 <= float(re.search(r"after waiting (\d+\.\d+) s", lines[0]).group(1)) < 5.0
    assert "paused or stopped inside its transaction" in lines[0]
    assert "batch of 2 message(s) consumed later" in lines[0]
    assert again == (ConsumeStatus.SUCCESS, 1, 0)
    assert counts == {"U0": 1, "U1": 1, "U2": 1, "held": 1}


async def test_sqlite_batches_grouped_while_the_lock_is_held_fail_together_after_one_wait(
        tmp_path):
    """Group commit: 20 batches that queue while another connection holds the write lock
    go in one transaction, which fails after one busy timeout; each batch fails with the
    retriable error at once (not one busy timeout after the other), then runs once."""
    db = Db("sqlite", tmp_path)
    db.create()
    ran: list[str] = []
    handle = db.handler()

    def counted(m, conn):
        ran.append(m.unique_key)
        handle(m, conn)

    lst = transactional(counted, db=db.url, table=db.table, busy_timeout_s=0.2)
    begins = trace_begins(lst)
    holder = sqlite3.connect(tmp_path / "shop.db", isolation_level=None)
    try:
        await call(lst, msgs(0))
        holder.execute("BEGIN IMMEDIATE")
        before = len(begins)
        errors: list[BaseException] = []
        real_run = lst.engine._run

        async def watched_run(*a, **kw):
            try:
                return await real_run(*a, **kw)
            except WriteLockTimeout as exc:
                errors.append(exc)
                raise

        lst.engine._run = watched_run
        started = time.monotonic()
        blocked = await asyncio.gather(*(call(lst, msgs(i)) for i in range(1, 21)))
        elapsed = time.monotonic() - started
        attempts = len(begins) - before
        holder.execute("ROLLBACK")
        retried = await asyncio.gather(*(call(lst, msgs(i)) for i in range(1, 21)))
    finally:
        holder.close()
        await lst.close()
    counts = db.counts()
    db.drop()
    assert blocked == [(ConsumeStatus.RECONSUME_LATER, 0, 0)] * 20
    assert len(errors) == 20
    # the batches queued behind the first one wait once together (the first may have
    # started alone): not one busy timeout per batch, and not retried at once
    assert attempts <= 2
    assert elapsed < 3.0  # two waits of 0.2 s; one per batch would take 4 s
    assert lst.stats["lock_timeouts"] == 20 and lst.stats["failed"] == 0
    assert retried == [(ConsumeStatus.SUCCESS, 0, 0)] * 20
    assert counts == {f"U{i}": 1 for i in range(21)}
    assert sorted(ran) == sorted(f"U{i}" for i in range(21))  # no handler ran twice


@pytest.mark.parametrize("point", ["before_commit", "after_commit"])
async def test_sigkill_before_or_after_the_commit_leaves_one_effect_each(db, tmp_path, addr,
                                                                        point):
    """A child consumer is SIGKILLed inside its transaction (after the business write, before
    the commit) or after committing but before its offset commit. The redelivery runs the
    uncommitted messages and skips the committed ones: one effect per message."""
    n = 30
    group = "billing"
    async with Admin(addr) as admin:
        await admin.create_topic("T", 2)
    async with Producer(addr) as p:
        sent = [r.unique_key for r in await p.send_batch("T", [f"order {i}".encode()
                                                               for i in range(n)])]
    extra = ["--transactional", db.effects]
    if point == "before_commit":
        extra.append("--hang-after-effect")
    child = await start_child(addr, group, db.url, db.table, tmp_path / "unused.db", *extra)
    try:
        if point == "before_commit":
            # a handler of the child has written (uncommitted) and hangs in its transaction
            line = await asyncio.wait_for(child.stdout.readline(), 30)
            assert line.startswith(b"HANGING"), line
            assert db.counts() == {}  # nothing committed
        else:
            await wait_until(lambda: len(db.counts()) == n, 30, "the child's commits")
    finally:
        child.kill()
        await child.wait()
    async with Admin(addr) as admin:
        committed = [await admin.group_offset(group, "T", q) for q in range(2)]
    assert sum(c or 0 for c in committed) < n  # the redelivery will happen
    second = transactional(db.handler(), db=db.url, table=db.table)
    consumer = PushConsumer(addr, group, second, consume_from="FIRST",
                            rebalance_interval_s=1.0)
    consumer.subscribe("T")
    await consumer.start()
    try:
        await wait_until(lambda: second.stats["handled"] + second.stats["duplicate"] >= n,
                         30, "the redelivery")
    finally:
        await consumer.shutdown()
        await second.close()
    counts = db.counts()
    assert sorted(counts) == sorted(sent) and set(counts.values()) == {1}
    if point == "after_commit":
        assert second.stats["handled"] == 0 and second.stats["duplicate"] >= n
    else:
        assert second.stats["handled"] == n


async def test_rows_past_retention_are_purged_in_bounded_batches(db):
    from tests.clock import FakeClock

    clock = FakeClock(1_000_000.0)
    lst = transactional(db.handler(), db=db.url, table=db.table, clock=clock,
                        retention_s=100, purge_interval_s=0)
    try:
        await call(lst, msgs(0, 1, 2))
        clock.advance(50)
        assert await lst.purge_expired(10) == 0
        await call(lst, msgs(3))
        clock.advance(51)  # rows 0-2 are 101 s old, row 3 is 51 s old
        assert await lst.purge_expired(2) == 2
        assert await lst.purge_expired(2) == 1
        assert await lst.purge_expired(2) == 0
        await call(lst, msgs(3))  # still known: not run again
        assert db.counts()["U3"] == 1
    finally:
        await lst.close()


async def test_a_failure_in_a_fresh_batch_redoes_the_messages_before_it_once_in_the_db(db):
    """A batch whose rows are all new runs without a savepoint per message. When message
    n fails, everything since the batch's savepoint is rolled back and the messages before
    n are done again one by one: their handlers run twice, their writes commit once."""
    calls: list[str] = []
    inner = db.handler(fail_on={"U2"})

    def handle(m: MessageExt, conn) -> None:
        calls.append(m.unique_key)
        inner(m, conn)

    lst = transactional(handle, db=db.url, table=db.table)
    try:
        assert await call(lst, msgs(0, 1, 2, 3)) == (ConsumeStatus.SUCCESS, 1, 0)
        assert calls == ["U0", "U1", "U2", "U0", "U1"]
        assert db.counts() == {"U0": 1, "U1": 1}
        assert lst.stats["handled"] == 2 and lst.stats["failed"] == 1
    finally:
        await lst.close()
