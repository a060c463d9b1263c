"""Transactional exactly-once: the dedup row and the business writes commit together.

``transactional(handler, db=URL)`` is a push-consumer listener for effects that all live in
one SQL database (SQLite, MariaDB/MySQL, PostgreSQL). Per listener batch, on one
connection and in one transaction:

1. for each message, under a savepoint: insert its dedup row (group, topic, key, payload
   hash, time). A row already there means "already done": the message is acknowledged
   without running the handler (or sent to the DLQ when its payload differs);
2. otherwise ``handler(message, connection)`` makes the business writes on the same
   connection (it must not commit or roll back). If it raises, the savepoint is rolled
   back (its writes and the dedup row vanish) and this message and the rest of the batch
   are retried;
3. one commit makes the dedup rows and the writes durable together.

Group commit: listener batches that arrive while the database is busy run in one
transaction, each under its own savepoints, and share one commit (one fsync). If that
transaction fails (a database error, not a handler's: those roll back their own savepoint),
nothing of it is committed and each batch runs again in a transaction of its own, so its
handlers run a second time, after their first writes were rolled back: effects inside the
database stay exactly once, as with any transaction retried after a serialisation failure.

A crash before the commit leaves nothing behind and the redelivery runs the handler; after
the commit the redelivery finds the rows. Two consumers with the same message at once:
the second insert waits on the first transaction's row (SQLite serialises writers) and
then finds it. No lease and no ambiguous outcome: the database decides. A member paused
inside its transaction keeps its rows locked: when it resumes it commits (the others then
find its rows) or, if the database ended its transaction meanwhile, commits nothing; no
fencing token is needed.

SQLite has one write lock per database: a member stopped inside its transaction (SIGSTOP,
a GC pause, a frozen VM) holds it, and every other member's batch waits for it. The wait
is bounded by ``busy_timeout_s`` (5 s): then the batch fails with ``WriteLockTimeout``,
one log line names the database, the wait and the likely cause, and the batch is consumed
later (nothing of it committed, nothing acknowledged), as a normal retry: it is not counted
as a handler failure. Batches grouped in one transaction fail together, without waiting
once more each. MariaDB and PostgreSQL lock rows, not the database: only the messages
whose rows the stopped member holds wait (their own lock timeouts, 10 s, bound that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..client.consume import ConsumeContext, ConsumeStatus
from ..log.record import MessageExt
from . import sa
from .dialects import Dialect, dialect_for_url
from .listener import DEFAULT_RETENTION_S, KeySpec, _stored_key, key_function
from .policy import Verdict, batch_reply
from .record import payload_hash
from .retention import RetentionChecked
from .sql import SqlStore
from .store import Purger, StoreError, WriteLockTimeout, check_name

__all__ = ["TransactionalListener", "transactional"]

log = logging.getLogger("onceq.idempotency")

Handler = Callable[[MessageExt, Any], None]

DEFAULT_BUSY_TIMEOUT_S = 5.0


def _done_schema(dialect: str) -> Callable[[str], list[str]]:
    double = {"sqlite": "REAL", "postgresql": "DOUBLE PRECISION"}.get(dialect, "DOUBLE")
    key = "TEXT" if dialect == "sqlite" else "VARCHAR(128)"
    dkey = "TEXT" if dialect == "sqlite" else "VARCHAR(255)"
    extra = (" ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
             if dialect == "mysql" else "")

    def make(t: str) -> list[str]:
        idx = f", INDEX {t}_created (created_at)" if dialect == "mysql" else ""
        stmts = [f"CREATE TABLE IF NOT EXISTS {t} (grp {key} NOT NULL, topic {key} NOT NULL, "
                 f"dkey {dkey} NOT NULL, payload_hash VARCHAR(64) NOT NULL, created_at "
                 f"{double} NOT NULL, PRIMARY KEY (grp, topic, dkey){idx}){extra}"]
        if dialect != "mysql":
            stmts.append(f"CREATE INDEX IF NOT EXISTS {t}_created ON {t} (created_at)")
        return stmts
    return make


def _dialect(url: str, busy_timeout_s: float | None = None) -> Dialect:
    d = dialect_for_url(url, memory_ok=False, busy_timeout_s=busy_timeout_s)
    transient = d.is_transient
    if d.name == "sqlite":
        # a locked database is not retried here: the batch fails after one busy timeout
        # and is consumed later (``WriteLockTimeout``)
        transient = _never
        insert = "INSERT INTO {t} (grp, topic, dkey, payload_hash, created_at) VALUES " \
                 "(?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        purge = ("DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE created_at < ? "
                 "LIMIT ?)")
    elif d.name == "mysql":
        # rowcount 0 on a duplicate (ON DUPLICATE KEY UPDATE counts found rows here)
        insert = "INSERT IGNORE INTO {t} (grp, topic, dkey, payload_hash, created_at) " \
                 "VALUES (?, ?, ?, ?, ?)"
        purge = "DELETE FROM {t} WHERE created_at < ? LIMIT ?"
    else:
        insert = "INSERT INTO {t} (grp, topic, dkey, payload_hash, created_at) VALUES " \
                 "(?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        purge = ("DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM {t} WHERE created_at < ? "
                 "LIMIT ?)")
    return dataclasses.replace(d, schema=_done_schema(d.name), insert_absent=insert,
                               purge=purge, is_transient=transient)


_DONE_TYPES = ("text", "text", "text", "text", "float8")  # the done table's columns


def _never(exc: BaseException) -> bool:
    return False


class TransactionalListener(RetentionChecked):
    """A listener wrapped by ``transactional``; ``stats`` counts what happened."""

    def __init__(self, handler: Handler, *, db: Any, key: KeySpec = None,
                 group: str | None = None, table: str = "onceq_done",
                 retention_s: float = DEFAULT_RETENTION_S, check_payload: bool = True,
                 pool_size: int | None = None, strict_retention: bool = True,
                 purge_interval_s: float = 60.0, purge_limit: int = 1000,
                 session: bool = False, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
                 clock: Callable[[], float] = time.time) -> None:
        if busy_timeout_s <= 0:
            raise ValueError("busy_timeout_s must be > 0")
        self.handler = handler
        self.sa_engine: Any = None  # a SQLAlchemy Engine the batches run on
        if sa.is_engine(db):
            self.sa_engine, db = db, sa.engine_url(db)
        elif session:
            raise ValueError("session=True needs a SQLAlchemy Engine as db")
        self.session = session
        query = {k: v[-1] for k, v in parse_qs(urlsplit(db).query).items()}
        self.table = check_name(query.get("table", table))
        self.busy_timeout_s = busy_timeout_s
        self.engine = SqlStore(_dialect(db, busy_timeout_s), clock=clock, table=self.table,
                               pool_size=pool_size)
        self.key_of = key_function(key)
        self.group = group
        self.retention_s = retention_s
        self.check_payload = check_payload
        self.strict_retention = strict_retention
        self.stats: Counter[str] = Counter()
        self._purger = Purger(self.purge_expired, purge_interval_s, purge_limit, self.stats)
        self._sa_ready = False

    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeStatus:
        group = self.group or ctx.group
        if not group:
            raise ValueError("transactional(): no consumer group (pass group=...)")
        self._purger.poke()
        items: list[tuple[MessageExt, str | None]] = []
        for m in msgs:
            try:
                items.append((m, _stored_key(self.key_of(m))))
            except Exception as exc:
                log.warning("no dedup key for %s@%d (%s): to the DLQ", m.topic,
                            m.queue_offset, exc)
                items.append((m, None))
        try:
            if self.sa_engine is not None:
                verdicts, counts = await self._sa_run(group, items)
            else:  # group commit with the batches queued meanwhile (see the docstring)
                verdicts, counts = await self.engine._run(self._batch_tx, group, items)
        except WriteLockTimeout as exc:
            # not the messages' fault: retried on the broker's schedule like any store
            # error (no DLQ verdict, not counted as a handler failure)
            self.stats["store_errors"] += 1
            self.stats["lock_timeouts"] += 1
            log.warning("transactional batch of %d message(s) consumed later: %s", len(msgs),
                        exc)
            return ConsumeStatus.RECONSUME_LATER
        except StoreError as exc:
            self.stats["store_errors"] += 1
            log.warning("transaction failed, batch of %d consumed later: %s", len(msgs), exc)
            return ConsumeStatus.RECONSUME_LATER
        self.stats.update(counts)  # here, on the event loop: counted once, after the commit
        for i, (v, (_, key)) in enumerate(zip(verdicts, items, strict=True)):
            if v is Verdict.DLQ:
                ctx.dlq_reasons[i] = (
                    "idempotency: no dedup key" if key is None else
                    f"idempotency: dedup key {key!r} already done with another payload; "
                    "not acknowledged as a duplicate")
        ack_index, delay = batch_reply(verdicts)
        ctx.ack_index = ack_index
        ctx.delay_level = delay
        return ConsumeStatus.SUCCESS

    async def _sa_run(self, group: str, items: list[tuple[MessageExt, str | None]]
                      ) -> tuple[list[Verdict], Counter[str]]:
        """The batch on a connection of the SQLAlchemy engine (in a worker thread)."""
        if not self._sa_ready:  # the table, through the store's own connection, once
            await self.engine._run(lambda cur, now: None, coalesce=False)
            self._sa_ready = True
        started = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.engine._executor, sa.run_in_sa_transaction, self.sa_engine,
                self.engine.dialect.begin, self._batch_tx, self.engine.clock(), group, items)
        except StoreError as exc:
            orig = getattr(exc.__cause__, "orig", None)  # the driver's error
            if orig is None or not self.engine.dialect.is_lock_timeout(orig):
                raise
            # the engine's own busy timeout applied (pysqlite's ``timeout``, 5 s by default)
            raise WriteLockTimeout(self.engine.dialect.database, time.monotonic() - started,
                                   None, f"{type(orig).__name__}: {orig}") from exc

    def _batch_tx(self, cur: Any, now: float, group: str,
                  items: list[tuple[MessageExt, str | None]]
                  ) -> tuple[list[Verdict], Counter[str]]:
        if self._all_fresh(cur, now, group, items):
            return self._run_fresh(cur, now, group, items)
        return self._one_by_one(cur, now, group, items)

    def _one_by_one(self, cur: Any, now: float, group: str,
                    items: list[tuple[MessageExt, str | None]]
                    ) -> tuple[list[Verdict], Counter[str]]:
        """Each message under a savepoint of its own: insert its dedup row, then run the
        handler where the row is new."""
        sql = self.engine._sql
        conn = cur.connection
        verdicts: list[Verdict] = []
        counts: Counter[str] = Counter()
        for m, key in items:
            if key is None:
                verdicts.append(Verdict.DLQ)
                counts["no_key"] += 1
                continue
            ph = payload_hash(m.body)
            cur.execute("SAVEPOINT onceq_msg")
            cur.execute(sql(self.engine.dialect.insert_absent), (group, m.topic, key, ph, now))
            if cur.rowcount == 0:  # already done (committed by someone, or earlier here)
                cur.execute(sql("SELECT payload_hash FROM {t} WHERE grp = ? AND topic = ? "
                                "AND dkey = ?"), (group, m.topic, key))
                row = cur.fetchone()
                cur.execute("RELEASE SAVEPOINT onceq_msg")
                if (self.check_payload and row is not None and row[0] and row[0] != ph):
                    counts["conflict"] += 1
                    log.error("%s@%d key %s to the DLQ: already seen with another payload",
                              m.topic, m.queue_offset, key)
                    verdicts.append(Verdict.DLQ)
                else:
                    counts["duplicate"] += 1
                    verdicts.append(Verdict.ACK)
                continue
            if not self._handle_in_savepoint(cur, conn, m):
                counts["failed"] += 1
                verdicts += [Verdict.LATER] * (len(items) - len(verdicts))
                break
            cur.execute("RELEASE SAVEPOINT onceq_msg")
            counts["handled"] += 1
            verdicts.append(Verdict.ACK)
        return verdicts, counts

    def _all_fresh(self, cur: Any, now: float, group: str,
                   items: list[tuple[MessageExt, str | None]]) -> bool:
        """Insert the batch's dedup rows in one statement under the savepoint
        ``onceq_batch``: True when every one was new (the savepoint stays open for
        ``_run_fresh``), so that each message only has to run; otherwise everything is
        rolled back to the savepoint and the messages are taken one by one."""
        rows = [(group, m.topic, key, payload_hash(m.body), now)
                for m, key in items if key is not None]
        if len(rows) < 2 or len({r[:3] for r in rows}) != len(rows):
            return False  # nothing to gain, or a key twice in the batch: one by one
        cur.execute("SAVEPOINT onceq_batch")
        inserted = 0
        engine = self.engine
        for source, params in engine._row_chunks(rows, _DONE_TYPES):
            cur.execute(engine._sql(engine.dialect.insert_absent.replace(
                "VALUES (?, ?, ?, ?, ?)", source)), params)
            inserted += cur.rowcount
        if inserted == len(rows):
            return True
        cur.execute("ROLLBACK TO SAVEPOINT onceq_batch")
        cur.execute("RELEASE SAVEPOINT onceq_batch")
        return False

    def _run_fresh(self, cur: Any, now: float, group: str,
                   items: list[tuple[MessageExt, str | None]]
                   ) -> tuple[list[Verdict], Counter[str]]:
        """Run the handler on each message whose dedup row this transaction just inserted
        (under the open savepoint ``onceq_batch``), with no savepoint per message: two
        statements less per message, round trips on a database server.

        When the handler fails on message ``n``, everything since the savepoint is rolled
        back (the batch's rows and every write of its handlers), and the messages before
        ``n`` are done again one by one (``_one_by_one``: their handlers run a second time,
        on a database where their first writes never happened); ``n`` and the rest are
        retried. Effects inside the database stay exactly once, as when a transaction is
        run again after a serialisation failure."""
        verdicts: list[Verdict] = []
        counts: Counter[str] = Counter()
        for n, (m, key) in enumerate(items):
            if key is None:
                verdicts.append(Verdict.DLQ)
                counts["no_key"] += 1
                continue
            try:
                if self.session:
                    sa.in_session(self.handler, m, cur.connection)
                else:
                    self.handler(m, cur.connection)
            except Exception:
                log.exception("handler failed on %s@%d; its writes are rolled back, the "
                              "message is retried", m.topic, m.queue_offset)
                cur.execute("ROLLBACK TO SAVEPOINT onceq_batch")
                cur.execute("RELEASE SAVEPOINT onceq_batch")
                verdicts, counts = self._one_by_one(cur, now, group, items[:n])
                counts["failed"] += 1
                return verdicts + [Verdict.LATER] * (len(items) - len(verdicts)), counts
            counts["handled"] += 1
            verdicts.append(Verdict.ACK)
        cur.execute("RELEASE SAVEPOINT onceq_batch")
        return verdicts, counts

    def _handle_in_savepoint(self, cur: Any, conn: Any, m: MessageExt) -> bool:
        """Run the handler inside the open savepoint ``onceq_msg``; on failure roll its
        writes back, release the savepoint and return False (the message is retried)."""
        try:
            if self.session:
                sa.in_session(self.handler, m, conn)
            else:
                self.handler(m, conn)
        except Exception:
            log.exception("handler failed on %s@%d; its writes are rolled back, the "
                          "message is retried", m.topic, m.queue_offset)
            cur.execute("ROLLBACK TO SAVEPOINT onceq_msg")
            cur.execute("RELEASE SAVEPOINT onceq_msg")
            return False
        return True

    async def purge_expired(self, limit: int = 1000) -> int:
        """Remove up to ``limit`` rows older than the retention."""
        def tx(cur: Any, now: float) -> int:
            cur.execute(self.engine._sql(self.engine.dialect.purge),
                        (now - self.retention_s, int(limit)))
            return max(cur.rowcount, 0)

        return await self.engine._run(tx)

    async def drop_table(self) -> None:
        await self.engine.drop_table()

    async def close(self) -> None:
        await self._purger.wait()
        await self.engine.close()


def transactional(handler: Handler, *, db: Any, key: KeySpec = None,
                  **options: Any) -> TransactionalListener:
    """Wrap ``handler(message, connection)`` so that its database writes and the message's
    dedup row commit in one transaction (exactly-once for effects inside that database)::

        def handle(m, conn):
            cur = conn.cursor()
            cur.execute("UPDATE orders SET status = 'PAID' WHERE id = %s", (m.keys,))

        consumer = PushConsumer(addr, "billing",
                                transactional(handle, db="postgresql://app@db/shop"))

    ``db``: ``sqlite:///path``, ``mysql://...``, ``postgresql://...`` (``?table=NAME``,
    default ``onceq_done``), or a SQLAlchemy ``Engine``: the handler then gets a SQLAlchemy
    ``Connection`` in the batch's transaction, or with ``session=True`` a ``Session``
    joined to it (its changes are flushed and committed with the dedup rows)::

        def handle(m, session):
            session.add(Payment(order=m.properties["order"], amount=...))

        transactional(handle, db=create_engine("postgresql+psycopg://app@db/shop"),
                      session=True)

    ``handler`` runs in a worker thread; it must not commit or roll back. Options: ``key``,
    ``group``, ``retention_s`` (1 day), ``check_payload``,
    ``pool_size`` (connections, 4; 1 for SQLite), ``strict_retention``,
    ``purge_interval_s`` (60; 0: off) and ``purge_limit`` (1000): rows past retention are
    removed in bounded batches; ``busy_timeout_s`` (5; SQLite given by URL): how long a
    batch waits for the database's write lock that another connection holds (a member
    paused inside its transaction) before it fails with ``WriteLockTimeout`` and is
    consumed later. Keep it above the longest transaction of a normal batch.
    """
    return TransactionalListener(handler, db=db, key=key, **options)
