"""SQL dedup stores: SQLite (embedded), MariaDB/MySQL (PyMySQL), PostgreSQL (psycopg 3).

One algorithm over DB-API connections, a small ``Dialect`` per database (``dialects``).
Each batch is one
transaction on a connection owned by a worker thread (the event loop never blocks):

* claim: insert a fresh ``CONSUMING`` row for every key that has none (``ON CONFLICT DO
  NOTHING`` / ``ON DUPLICATE KEY UPDATE`` no-op), read the batch's rows under a row lock
  (``FOR UPDATE``; SQLite serialises writers with ``BEGIN IMMEDIATE``), apply
  ``record.decide_claim`` to each, write back the rows it changed with ``WHERE owner = <the
  owner read>``. A row whose owner is the claim's own token was inserted by this claim.
* complete / release / extend: read the rows of the given owner tokens under the lock,
  then update or delete those that are still owned: a token that was fenced off (its row
  taken over by another owner, or gone) matches nothing.

Keys are sorted inside a transaction so that two batches lock rows in the same order;
deadlocks and serialisation failures the database reports are retried. An SQLite write lock
not obtained within the connection's busy timeout (after the dialect's retries, if it
retries) is a ``WriteLockTimeout`` naming the database and the time waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .dialects import COLS, ROW, Dialect, mysql_dialect, postgres_dialect, sqlite_dialect
from .record import (
    Claim,
    ClaimResult,
    Outcome,
    Record,
    Status,
    Ticket,
    decide_claim,
    history_line,
)
from .store import MAX_KEY_LEN, Clock, StoreError, StoreStats, WriteLockTimeout, check_name

__all__ = ["Dialect", "SqlStore", "mysql_dialect", "postgres_dialect", "sqlite_dialect"]

_TRANSIENT_TRIES = 8
_GROUP_MAX = 64  # operations committed together at most


def _row_record(row: Sequence[Any]) -> Record:
    return Record(row[0], row[1], row[2], Status(row[3]), row[4], int(row[5]), float(row[6]),
                  row[7], float(row[8]), float(row[9]), float(row[10]), row[11] or "")


def _row_values(r: Record) -> tuple[Any, ...]:
    return (r.group, r.topic, r.key, r.status.value, r.owner, r.attempt, r.lease_until,
            r.payload_hash, r.created_at, r.updated_at, r.expires_at, r.history)


class SqlStore:
    """A dedup store in a SQL table (``table``, created on first use)."""

    def __init__(self, dialect: Dialect, *, clock: Clock = time.time,
                 table: str = "onceq_dedup", pool_size: int | str | None = None,
                 synchronous: str | None = None) -> None:
        if synchronous is not None:  # SQLite: FULL (default) or NORMAL
            if dialect.name != "sqlite" or synchronous.upper() not in ("FULL", "NORMAL"):
                raise ValueError("synchronous is an SQLite option: FULL or NORMAL")
            dialect.connect = dialect.sync_connect(synchronous.upper())
        self.dialect = dialect
        self.clock = clock
        self.table = check_name(table)
        self._p = dialect.param
        size = int(pool_size) if pool_size is not None else dialect.pool_size
        self._size = max(1, size)
        self._executor = ThreadPoolExecutor(self._size,
                                            thread_name_prefix=f"onceq-dedup-{dialect.name}")
        self._queue: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._drainers = 0
        self._drain_tasks: set[asyncio.Task[None]] = set()
        self._local = threading.local()
        self._conns: list[Any] = []
        self._conns_lock = threading.Lock()
        self._schema_ready = False
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    def _sql(self, text: str) -> str:
        return text.replace("{t}", self.table).replace("?", self._p)

    def _marks(self, n: int) -> str:
        return ", ".join([self._p] * n)

    def _in(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """``column IN (...)``, or ``column = ANY(?)`` with one array parameter where the
        database takes arrays: the statement text then stays the same whatever the batch
        size, so the driver prepares it once and the planner plans it once."""
        if self.dialect.array_in:
            return f"{column} = ANY(?)", [list(values)]
        return f"{column} IN ({self._marks(len(values))})", list(values)

    def _rows(self, n_columns: int, rows: Sequence[Sequence[Any]],
              types: Sequence[str] = ()) -> tuple[str, list[Any]]:
        """Rows as a source for ``INSERT ... <source>`` or ``(cols) IN (<source>)``: one
        array per column (``SELECT * FROM unnest(...)``, ``types`` the columns' SQL types)
        where the database takes arrays, else ``VALUES (...), ...``."""
        if self.dialect.array_in:
            arrays = ", ".join(f"?::{t}[]" for t in (types or ["text"] * n_columns))
            return f"SELECT * FROM unnest({arrays})", [list(col) for col in zip(*rows,
                                                                               strict=True)]
        row = f"({self._marks(n_columns)})"
        return f"VALUES {', '.join([row] * len(rows))}", [v for r in rows for v in r]

    def _row_chunks(self, rows: Sequence[Sequence[Any]], types: Sequence[str]
                    ) -> Iterator[tuple[str, list[Any]]]:
        """``_rows`` of ``rows`` for one statement each: all of them as arrays, else 500
        rows of ``VALUES`` a statement."""
        step = len(rows) if self.dialect.array_in else 500
        for i in range(0, len(rows), step):
            yield self._rows(len(rows[0]), rows[i:i + step], types)

    def _connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self.dialect.connect()
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
            if not self._schema_ready:
                self._create_schema(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._conns_lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            with contextlib.suppress(Exception):  # already broken: nothing to do
                conn.close()

    def _create_schema(self, conn: Any) -> None:
        for attempt in range(3):
            try:
                cur = conn.cursor()
                for stmt in self.dialect.schema(self.table):
                    cur.execute(stmt)
                conn.commit()
                self._add_history_column(conn)
                break
            except self.dialect.errors:
                # another process created the table at the same instant: look again
                conn.rollback()
                if attempt == 2:
                    raise
                time.sleep(0.05)
        self._schema_ready = True

    def _add_history_column(self, conn: Any) -> None:
        """A table made before records kept their history gets the column."""
        cur = conn.cursor()
        try:
            cur.execute(self._sql("SELECT history FROM {t} WHERE 1 = 0"))
            cur.fetchall()
            conn.commit()
        except self.dialect.errors:
            conn.rollback()
            cur = conn.cursor()
            cur.execute(self._sql("ALTER TABLE {t} ADD COLUMN history TEXT"))
            conn.commit()

    def _tx(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(cursor, now, *args)`` in one transaction on this thread's connection."""
        d = self.dialect
        started = time.monotonic()
        for attempt in range(_TRANSIENT_TRIES):
            conn = None
            try:
                conn = self._connection()
                cur = conn.cursor()
                if d.begin:
                    cur.execute(d.begin)
                result = fn(cur, self.clock(), *args)
                conn.commit()
                return result
            except d.errors as exc:
                try:
                    if conn is not None:
                        conn.rollback()
                except Exception:
                    self._drop_connection()
                if d.is_transient(exc) and attempt < _TRANSIENT_TRIES - 1:
                    time.sleep(random.uniform(0.001, 0.01) * (attempt + 1))
                    continue
                if d.is_lock_timeout(exc):
                    if not self._schema_ready:  # the next call creates the table again
                        self._drop_connection()
                    raise WriteLockTimeout(d.database, time.monotonic() - started,
                                           d.busy_timeout_s, f"{type(exc).__name__}: {exc}"
                                           ) from exc
                self._drop_connection()  # reconnect on the next call
                raise StoreError(f"{d.name} dedup store: {type(exc).__name__}: {exc}") from exc
            except OSError as exc:
                self._drop_connection()
                raise StoreError(f"{d.name} dedup store: {exc}") from exc
            except BaseException:
                # never leave a transaction open (its row locks would block every other
                # consumer): roll back, or drop the connection if even that fails
                try:
                    if conn is not None:
                        conn.rollback()
                except Exception:
                    self._drop_connection()
                raise
        raise AssertionError("unreachable")

    async def _run(self, fn: Callable[..., Any], *args: Any, coalesce: bool = True) -> Any:
        """Run ``fn(cursor, now, *args)`` in a transaction on a worker thread.

        Group commit: operations that arrive while the workers are busy wait in a queue, and
        a worker runs everything queued in one transaction (one commit, so one fsync, for
        many listener batches). Each operation stays atomic (the group is); if the group
        fails, its operations are run again one transaction each, so that one failure
        does not fail the others, unless the database's write lock was not obtained
        (``WriteLockTimeout``, SQLite): another connection holds it, so every operation
        of the group fails with that error after the one wait.
        """
        if self._closed:
            raise StoreError("the dedup store is closed")
        loop = asyncio.get_running_loop()
        if not coalesce:
            return await loop.run_in_executor(self._executor, self._tx, fn, *args)
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((fn, args, fut))
        if self._drainers < self._size:
            self._drainers += 1
            task = loop.create_task(self._drain())
            self._drain_tasks.add(task)
            task.add_done_callback(self._drain_tasks.discard)
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        ops: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        try:
            while self._queue:
                ops, self._queue = self._queue[:_GROUP_MAX], self._queue[_GROUP_MAX:]
                outcomes = await loop.run_in_executor(self._executor, self._tx_group,
                                                      [(fn, a) for fn, a, _ in ops])
                for (_, _, fut), (ok, value) in zip(ops, outcomes, strict=True):
                    if fut.done():
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
        except Exception as exc:  # e.g. closed meanwhile: never leave a caller waiting
            for _, _, fut in ops + self._queue:
                if not fut.done():
                    fut.set_exception(StoreError(f"dedup store: {exc!r}"))
            self._queue = []
        finally:
            self._drainers -= 1

    def _tx_group(self, ops: list[tuple[Callable[..., Any], tuple[Any, ...]]]
                  ) -> list[tuple[bool, Any]]:
        def group(cur: Any, now: float) -> list[Any]:
            return [fn(cur, now, *args) for fn, args in ops]

        if len(ops) > 1:
            try:
                return [(True, v) for v in self._tx(group)]
            except WriteLockTimeout as exc:
                # another connection holds the database's write lock: each operation on
                # its own would wait for it again, one busy timeout after the other
                return [(False, exc)] * len(ops)
            except Exception:
                pass  # one of them failed: each on its own, to isolate the failure
        out: list[tuple[bool, Any]] = []
        for fn, args in ops:
            try:
                out.append((True, self._tx(fn, *args)))
            except Exception as exc:
                out.append((False, exc))
        return out

    # ------------------------------------------------------------------ claims
    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimResult]:
        if not claims:
            return []
        for c in claims:
            if len(c.key) > MAX_KEY_LEN:
                raise ValueError(f"dedup key longer than {MAX_KEY_LEN} characters")
            # the columns' widths: a longer value is refused, never cut to fit
            if len(c.owner) > 100 or len(c.payload_hash) > 64 or max(
                    len(c.group), len(c.topic)) > 128:
                raise ValueError("owner token over 100, payload hash over 64, or group or "
                                 "topic over 128 characters")
        return await self._run(self._claim_tx, list(claims))

    def _claim_tx(self, cur: Any, now: float, claims: list[Claim]) -> list[ClaimResult]:
        first: dict[tuple[str, str, str], Claim] = {}
        for c in claims:
            first.setdefault((c.group, c.topic, c.key), c)
        fresh = []
        claimed = history_line(now, "claimed", 1, "")[:-1]  # + owner + newline
        consuming = Status.CONSUMING.value
        for k in sorted(first):
            c = first[k]
            lease_until = now + c.lease_s
            fresh.append((*k, consuming, c.owner, 1, lease_until, c.payload_hash, now, now,
                          lease_until + c.retention_s, f"{claimed}{c.owner}\n"))
        inserted = 0
        for source, params in self._row_chunks(fresh, self.dialect.column_types):
            cur.execute(self._sql(self.dialect.insert_absent.replace(f"VALUES {ROW}", source)),
                        params)
            inserted += cur.rowcount
        if (self.dialect.counts_inserts and inserted == len(fresh)
                and len(first) == len(claims)):
            # every row was inserted by this claim (none existed, alive or not), one per
            # claim: each claim got the row just written (``decide_claim`` of an absent
            # record), no need to read them back (the common case)
            recs = {row[:3]: Record(row[0], row[1], row[2], Status.CONSUMING, *row[4:])
                    for row in fresh}
            return [ClaimResult(Outcome.CLAIMED, recs[(c.group, c.topic, c.key)])
                    for c in claims]
        current: dict[tuple[str, str, str], Record] = {}
        by_gt: dict[tuple[str, str], list[str]] = defaultdict(list)
        for g, t, k in sorted(first):
            by_gt[(g, t)].append(k)
        for (g, t), keys in by_gt.items():
            cond, params = self._in("dkey", keys)
            cur.execute(self._sql(f"SELECT {COLS} FROM {{t}} WHERE grp = ? AND topic = ? AND "
                                  f"{cond}{self.dialect.lock}"), (g, t, *params))
            for row in cur.fetchall():
                rec = _row_record(row)
                current[(rec.group, rec.topic, rec.key)] = rec
        out = []
        for c in claims:
            k = (c.group, c.topic, c.key)
            existing = current.get(k)
            res, new = decide_claim(existing, c, now)
            if new is not None:
                if existing is None:  # cannot happen after the insert; stay correct anyway
                    cur.execute(self._sql(self.dialect.insert_absent), _row_values(new))
                else:
                    cur.execute(self._sql(
                        "UPDATE {t} SET status = ?, owner = ?, attempt = ?, lease_until = ?, "
                        "payload_hash = ?, created_at = ?, updated_at = ?, expires_at = ?, "
                        "history = ? WHERE grp = ? AND topic = ? AND dkey = ? AND owner = ?"),
                        (*_row_values(new)[3:], *k, existing.owner))
                    if cur.rowcount != 1:
                        raise StoreError(f"claim of {k} lost its row lock")
                current[k] = new
            out.append(res)
        return out

    # ------------------------------------------------------------------ compare-and-set
    def _owned(self, cur: Any, now: float, tickets: Sequence[Ticket]) -> list[str | None]:
        """Per ticket, the status of its record if the ticket still owns it (else None);
        the rows read are locked until the end of the transaction."""
        cond, params = self._in("owner", sorted({t.owner for t in tickets}))
        cur.execute(self._sql(f"SELECT grp, topic, dkey, owner, status FROM {{t}} WHERE {cond} "
                              f"AND expires_at > ?{self.dialect.lock}"), (*params, now))
        # keyed by the whole ticket: one owner token may hold several records
        rows = {(r[0], r[1], r[2], r[3]): r[4] for r in cur.fetchall()}
        return [rows.get((t.group, t.topic, t.key, t.owner)) for t in tickets]

    def _event(self, event: str, now: float) -> tuple[str, list[Any]]:
        """``history = ...`` appending ``event`` by each updated row's own owner."""
        return (self.dialect.history_set(["?", self.dialect.int_text, "' '", "owner", "?"]),
                [f"{now:.3f} {event} ", "\n"])

    def _fence(self, cur: Any, now: float, tickets: Sequence[Ticket],
               statuses: Sequence[str | None]) -> None:
        """Note ``fenced-off`` in the history of the records that stale tickets lost."""
        hist = self.dialect.history_set(["?", self.dialect.int_text, "?"])
        for t, st in zip(tickets, statuses, strict=True):
            if st is None:
                cur.execute(self._sql(f"UPDATE {{t}} SET {hist} WHERE grp = ? AND topic = ? "
                                      "AND dkey = ? AND owner <> ? AND expires_at > ?"),
                            (f"{now:.3f} fenced-off ", f" {t.owner}\n", t.group, t.topic,
                             t.key, t.owner, now))

    def _cas_update(self, cur: Any, now: float, tickets: list[Ticket], event: str,
                    sets: str, values: Sequence[Any]) -> list[str | None]:
        """``UPDATE SET <sets>`` (and the event in the history) on the ``CONSUMING`` records
        the tickets still own; fence off the others; the statuses ``_owned`` found."""
        statuses = self._owned(cur, now, tickets)
        won = sorted({t.owner for t, st in zip(tickets, statuses, strict=True)
                      if st == Status.CONSUMING.value})
        if won:
            cond, params = self._in("owner", won)
            hist, hparams = self._event(event, now)
            cur.execute(self._sql(f"UPDATE {{t}} SET {hist}, {sets} WHERE {cond}"),
                        (*hparams, *values, *params))
        self._fence(cur, now, tickets, statuses)
        return statuses

    async def complete_many(self, tickets: Sequence[Ticket], retention_s: float) -> list[bool]:
        if not tickets:
            return []
        return await self._run(self._complete_tx, list(tickets), retention_s)

    def _complete_tx(self, cur: Any, now: float, tickets: list[Ticket], retention_s: float
                     ) -> list[bool]:
        done = Status.CONSUMED.value
        if self.dialect.row_values_in:
            # one statement in the common case: mark CONSUMED every row that is still
            # CONSUMING under exactly (group, topic, key, owner) of a ticket; when it
            # matched them all, every ticket won. Otherwise some were fenced off or had
            # completed already: read which (the rows just marked are owned and alive).
            distinct = sorted(set(tickets), key=lambda t: (t.group, t.topic, t.key, t.owner))
            owners, oparams = self._in("owner", sorted({t.owner for t in distinct}))
            hist, hparams = self._event("completed", now)
            source, tparams = self._rows(4, distinct)
            cur.execute(self._sql(
                f"UPDATE {{t}} SET {hist}, status = ?, updated_at = ?, expires_at = ? WHERE "
                f"{owners} AND (grp, topic, dkey, owner) IN ({source}) AND status = ? "
                f"AND expires_at > ?"),
                (*hparams, done, now, now + retention_s, *oparams, *tparams,
                 Status.CONSUMING.value, now))
            if cur.rowcount == len(distinct):
                return [True] * len(tickets)
            statuses = self._owned(cur, now, tickets)
            if Status.CONSUMING.value in statuses:  # cannot be: the update took them all
                raise StoreError("complete: a claim escaped its update")
            self._fence(cur, now, tickets, statuses)
            return [st == done for st in statuses]
        statuses = self._cas_update(cur, now, tickets, "completed",
                                    "status = ?, updated_at = ?, expires_at = ?",
                                    (done, now, now + retention_s))
        # completed twice by its owner: won, nothing changes
        return [st in (Status.CONSUMING.value, done) for st in statuses]

    async def release_many(self, tickets: Sequence[Ticket]) -> list[bool]:
        if not tickets:
            return []
        return await self._run(self._release_tx, list(tickets))

    def _release_tx(self, cur: Any, now: float, tickets: list[Ticket]) -> list[bool]:
        return [st == Status.CONSUMING.value for st in self._cas_update(
            cur, now, tickets, "released", "status = ?, lease_until = ?, updated_at = ?",
            (Status.RELEASED.value, now, now))]

    async def extend_many(self, tickets: Sequence[Ticket], lease_s: float,
                          retention_s: float) -> list[bool]:
        if not tickets:
            return []
        return await self._run(self._extend_tx, list(tickets), lease_s, retention_s)

    def _extend_tx(self, cur: Any, now: float, tickets: list[Ticket], lease_s: float,
                   retention_s: float) -> list[bool]:
        return [st == Status.CONSUMING.value for st in self._cas_update(
            cur, now, tickets, "extended", "lease_until = ?, updated_at = ?, expires_at = ?",
            (now + lease_s, now, now + lease_s + retention_s))]

    # ------------------------------------------------------------------ operator view
    async def get(self, group: str, topic: str, key: str) -> Record | None:
        def tx(cur: Any, now: float) -> Record | None:
            cur.execute(self._sql(f"SELECT {COLS} FROM {{t}} WHERE grp = ? AND topic = ? AND "
                                  "dkey = ? AND expires_at > ?"), (group, topic, key, now))
            row = cur.fetchone()
            return _row_record(row) if row else None

        return await self._run(tx)

    async def purge_expired(self, limit: int = 1000, updated_before: float = 0.0) -> int:
        def tx(cur: Any, now: float) -> int:
            cur.execute(self._sql(self.dialect.purge), (now, int(limit)))
            n = max(cur.rowcount, 0)
            if updated_before > 0 and n < limit:  # the operator's purge (a table scan)
                cur.execute(self._sql(self.dialect.purge.replace("expires_at <= ?",
                                                                 "updated_at < ?")),
                            (updated_before, int(limit) - n))
                n += max(cur.rowcount, 0)
            return n

        return await self._run(tx)

    async def stats(self) -> StoreStats:
        def tx(cur: Any, now: float) -> StoreStats:
            cur.execute(self._sql("SELECT status, COUNT(*) FROM {t} WHERE expires_at > ? "
                                  "GROUP BY status"), (now,))
            counts = {s: int(n) for s, n in cur.fetchall()}
            return StoreStats(*(counts.get(st.value, 0) for st in Status))

        return await self._run(tx)

    async def drop_table(self) -> None:
        """Remove the table (tests and the operator's reset)."""
        def tx(cur: Any, now: float) -> None:
            cur.execute(self._sql("DROP TABLE IF EXISTS {t}"))

        await self._run(tx)
        self._schema_ready = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._close_all)

    def _close_all(self) -> None:
        self._executor.shutdown(wait=True)
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
