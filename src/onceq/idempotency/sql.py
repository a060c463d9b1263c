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
* the listener's path (``claim_keys``, ``complete_keys``): the completions and claims of a
  group go in one statement each (``_apply_group``), or, on PostgreSQL and MariaDB, all of
  them in one round trip that commits (``_one_trip``); a group that finds anything but
  fresh keys and owned claims runs again by the rules above.

Keys are sorted inside a transaction so that two batches lock rows in the same order;
deadlocks and serialisation failures the database reports are retried. An SQLite write lock
not obtained within the connection's busy timeout (after the dialect's retries, if it
retries) is a ``WriteLockTimeout`` naming the database and the time waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
from .store import (
    MAX_KEY_LEN,
    Clock,
    KeyClaim,
    StoreError,
    StoreStats,
    WriteLockTimeout,
    check_name,
)

__all__ = ["Dialect", "SqlStore", "mysql_dialect", "postgres_dialect", "sqlite_dialect"]

log = logging.getLogger("onceq.idempotency")

_TRANSIENT_TRIES = 8
_ONE_TRIP_TRIES = 5  # one-trip calls failing in a row before a store stops trying them
_GROUP_MAX = 64  # operations committed together at most


# The listener's completions and claims in one statement (``SqlStore._one_trip``).
# Parameters: completions as JSON [[group, topic, key, owner, expiry], ...], the history
# line's two parts, CONSUMED, now, CONSUMING, now; then CONSUMING, now, now, the claim
# history's prefix, a newline, claims as JSON [[group, topic, key, owner, payload hash,
# lease end, expiry], ...].
_PG_ONE_TRIP = (
    "WITH v AS (SELECT e->>0 AS g, e->>1 AS tp, e->>2 AS k, e->>3 AS o, "
    "(e->>4)::float8 AS ex FROM json_array_elements(?::json) AS e), "
    "c AS (UPDATE {{t}} AS d SET {hist}, status = ?, updated_at = ?, expires_at = v.ex "
    "FROM v WHERE d.grp = v.g AND d.topic = v.tp AND d.dkey = v.k AND d.owner = v.o "
    "AND d.status = ? AND d.expires_at > ? RETURNING 1), "
    f"i AS (INSERT INTO {{{{t}}}} ({COLS}) SELECT e->>0, e->>1, e->>2, ?, e->>3, 1, "
    "(e->>5)::float8, e->>4, ?, ?, (e->>6)::float8, ? || (e->>3) || ? "
    "FROM json_array_elements(?::json) AS e ON CONFLICT DO NOTHING RETURNING 1) "
    "SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM i)")

_JSON_KEYS = ("g VARCHAR(128) COLLATE utf8mb4_bin PATH '$[0]', tp VARCHAR(128) COLLATE "
              "utf8mb4_bin PATH '$[1]', k VARCHAR(255) COLLATE utf8mb4_bin PATH '$[2]', "
              "o VARCHAR(100) COLLATE utf8mb4_bin PATH '$[3]'")
_MYSQL_ONE_TRIP = (
    "UPDATE {{t}} AS d JOIN JSON_TABLE(?, '$[*]' COLUMNS (" + _JSON_KEYS + ", "
    "ex DOUBLE PATH '$[4]')) AS v ON d.grp = v.g AND d.topic = v.tp AND d.dkey = v.k AND "
    "d.owner = v.o SET {hist}, d.status = ?, d.updated_at = ?, d.expires_at = v.ex "
    "WHERE d.status = ? AND d.expires_at > ?; "
    f"INSERT IGNORE INTO {{{{t}}}} ({COLS}) SELECT j.g, j.tp, j.k, ?, j.o, 1, j.lu, j.ph, "
    "?, ?, j.ex, CONCAT(?, j.o, ?) FROM JSON_TABLE(?, '$[*]' COLUMNS (" + _JSON_KEYS + ", "
    "ph VARCHAR(64) PATH '$[4]', lu DOUBLE PATH '$[5]', ex DOUBLE PATH '$[6]')) AS j; "
    "COMMIT")


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
        # one-trip calls that failed in a row: past _ONE_TRIP_TRIES (a server without
        # JSON_TABLE, say) the groups take the transaction path only
        self._one_trip_failures = 0 if dialect.one_trip else _ONE_TRIP_TRIES

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
                self._add_reply_column(conn)
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

    def _add_reply_column(self, conn: Any) -> None:
        """The ``reply`` column (request-reply, ``replies.py``): added to a table that has
        none, whenever it was made; the other statements never name it."""
        cur = conn.cursor()
        try:
            cur.execute(self._sql("SELECT reply FROM {t} WHERE 1 = 0"))
            cur.fetchall()
            conn.commit()
            return
        except self.dialect.errors:
            conn.rollback()
        blob = {"sqlite": "BLOB", "postgresql": "BYTEA"}.get(self.dialect.name, "LONGBLOB")
        cur = conn.cursor()
        try:
            cur.execute(self._sql(f"ALTER TABLE {{t}} ADD COLUMN reply {blob}"))
            conn.commit()
        except self.dialect.errors:  # another process added it at the same instant
            conn.rollback()

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
        if self._one_trip_failures < _ONE_TRIP_TRIES and all(
                fn == self._claim_keys_op or fn == self._complete_keys_op for fn, _ in ops):
            done = self._one_trip(ops)
            if done is not None:
                return [(True, v) for v in done]

        def group(cur: Any, now: float) -> list[Any]:
            return self._apply_group(cur, now, ops)

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

    def _apply_group(self, cur: Any, now: float,
                     ops: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
        """The operations of one transaction. The listener's completions of the group go
        in one statement, then its claims in one statement (the completion of one batch
        rides with the claims of the next ones); the other operations follow in their
        order. Every caller waited for its own operation, none of them saw another's
        result, so any order is a valid one; completions first turn copies of just
        finished messages into duplicates instead of busy claims."""
        out: list[Any] = [None] * len(ops)
        completes = [i for i, (fn, _) in enumerate(ops) if fn == self._complete_keys_op]
        claims = [i for i, (fn, _) in enumerate(ops) if fn == self._claim_keys_op]
        if completes:
            for i, res in zip(completes, self._complete_keys_merged(
                    cur, now, [ops[i][1] for i in completes]), strict=True):
                out[i] = res
        if claims:
            for i, res in zip(claims, self._claim_keys_merged(
                    cur, now, [ops[i][1] for i in claims]), strict=True):
                out[i] = res
        if len(completes) + len(claims) < len(ops):
            merged = set(completes) | set(claims)
            for i, (fn, args) in enumerate(ops):
                if i not in merged:
                    out[i] = fn(cur, now, *args)
        return out

    def _one_trip(self, ops: list[tuple[Callable[..., Any], tuple[Any, ...]]]
                  ) -> list[Any] | None:
        """The listener's completions and claims of a group in one round trip and one
        commit (PostgreSQL: one statement, MariaDB/MySQL: one multi-statement call ending
        with COMMIT). The rows travel as one JSON parameter per kind.

        What it commits is right whatever else happens: a completion changes only a row
        still ``CONSUMING`` under the claim's own owner token, a claim only inserts a
        fresh row where the key has none (``decide_claim`` of an absent record). When the
        counts say every completion and every claim did so, that is every result. If not
        (a key already known, a fenced-off owner), or if the call failed, the group runs
        again by the full rules in a transaction (``_apply_group``): there, a completion
        already made counts as won (``CONSUMED`` by its owner), and a claim finds the row
        it inserted under its own owner token, which the rules answer ``CLAIMED`` with the
        same record. None: run the group that way."""
        d = self.dialect
        now = self.clock()
        completes: list[list[Any]] = []
        claims: list[list[Any]] = []
        for fn, args in ops:
            if fn == self._complete_keys_op:
                group, items, retention_s = args
                completes += [[group, t, k, o, now + retention_s] for t, k, o, _ in items]
            else:
                group, items, lease_s, retention_s, _ = args
                lease_until = now + lease_s
                expires_at = lease_until + retention_s
                claims += [[group, t, k, o, p, lease_until, expires_at] for t, k, o, p in items]
        completes.sort()  # the same lock order in every transaction
        claims.sort()
        hist, hparams = self._event("completed", now)
        claimed = history_line(now, "claimed", 1, "")[:-1]
        params = (json.dumps(completes), *hparams, Status.CONSUMED.value, now,
                  Status.CONSUMING.value, now, Status.CONSUMING.value, now, now, claimed,
                  "\n", json.dumps(claims))
        conn = None
        try:
            conn = self._connection()
            cur = conn.cursor()
            if d.name == "postgresql":
                conn.autocommit = True  # one statement, its own transaction
                try:
                    cur.execute(self._sql(_PG_ONE_TRIP.format(hist=hist)), params)
                    counts = tuple(cur.fetchone())
                finally:
                    conn.autocommit = False
            else:
                cur.execute(self._sql(_MYSQL_ONE_TRIP.format(hist=hist)), params)
                completed = cur.rowcount
                cur.nextset()
                counts = (completed, cur.rowcount)
                while cur.nextset():  # the COMMIT's
                    pass
        except (*d.errors, OSError, StoreError) as exc:
            try:
                if conn is not None:
                    conn.rollback()
            except Exception:
                self._drop_connection()
            self._one_trip_failures += 1
            if self._one_trip_failures == _ONE_TRIP_TRIES:
                log.warning("%s dedup store: one-round-trip groups failed %d times in a row "
                            "(last: %s: %s); using one transaction per group from now on",
                            d.name, _ONE_TRIP_TRIES, type(exc).__name__, exc)
            return None  # the transaction path retries, or says what is wrong
        self._one_trip_failures = 0
        if counts != (len(completes), len(claims)):
            return None
        return [[True] * len(args[1]) if fn == self._complete_keys_op else (now, {})
                for fn, args in ops]

    # ------------------------------------------------------------------ the listener's path
    async def claim_keys(self, group: str, items: Sequence[KeyClaim], lease_s: float,
                         retention_s: float, check_payload: bool
                         ) -> tuple[float, dict[int, ClaimResult]]:
        """``store.claim_keys``: the claims of a listener batch as tuples; the store's time
        and the results of the claims that found a record (see ``_claim_keys_merged``)."""
        if not items:
            return self.clock(), {}
        if len(group) > 128:
            raise ValueError("group over 128 characters")
        for t, k, o, p in items:
            if len(k) > MAX_KEY_LEN or len(o) > 100 or len(p) > 64 or len(t) > 128:
                if len(k) > MAX_KEY_LEN:
                    raise ValueError(f"dedup key longer than {MAX_KEY_LEN} characters")
                raise ValueError("owner token over 100, payload hash over 64, or group or "
                                 "topic over 128 characters")
        return await self._run(self._claim_keys_op, group, items, lease_s, retention_s,
                               check_payload)

    def _claim_keys_op(self, cur: Any, now: float, *args: Any
                       ) -> tuple[float, dict[int, ClaimResult]]:
        return self._claim_keys_merged(cur, now, [args])[0]

    def _claim_keys_merged(self, cur: Any, now: float, ops: list[tuple[Any, ...]]
                           ) -> list[tuple[float, dict[int, ClaimResult]]]:
        """The claims of several listener batches: one insert of a fresh ``CONSUMING`` row
        per claim (nothing where the key has a row). When every row went in, every claim
        created its record (``decide_claim`` of an absent one): nothing to read back and
        no result object per message. Otherwise each batch is claimed again by the full
        rule (``_claim_tx``): its own rows just inserted are found with its own owner
        tokens, which the rules answer ``CLAIMED`` with the same record."""
        claimed = history_line(now, "claimed", 1, "")[:-1]  # + owner + newline
        consuming = Status.CONSUMING.value
        rows = []
        for group, items, lease_s, retention_s, _ in ops:
            lease_until = now + lease_s
            expires_at = lease_until + retention_s
            rows += [(group, t, k, consuming, o, 1, lease_until, p, now, now, expires_at,
                      f"{claimed}{o}\n") for t, k, o, p in items]
        if self.dialect.counts_inserts and self._insert_fresh(cur, rows) == len(rows):
            return [(now, {})] * len(ops)
        out = []
        for group, items, lease_s, retention_s, check in ops:
            results = self._claim_tx(cur, now, [
                Claim(group, t, k, o, p, lease_s, retention_s, check) for t, k, o, p in items])
            out.append((now, dict(enumerate(results))))
        return out

    def _insert_fresh(self, cur: Any, rows: list[tuple[Any, ...]]) -> int:
        """Insert ``rows`` where their key has none; the number inserted."""
        # multi-row statements, not ``executemany``: SQLite's module releases and takes
        # back the GIL around every step, and a step per row waits for the GIL each time
        # the event loop is busy (a handler doing CPU work)
        if self.dialect.name != "sqlite":
            rows.sort(key=lambda r: r[:3])  # the same lock order in every transaction
        inserted = 0
        for source, params in self._row_chunks(rows, self.dialect.column_types):
            cur.execute(self._sql(self.dialect.insert_absent.replace(f"VALUES {ROW}", source)),
                        params)
            inserted += cur.rowcount
        return inserted

    async def complete_keys(self, group: str, items: Sequence[KeyClaim], retention_s: float
                            ) -> list[bool]:
        """``store.complete_keys``: ``complete_many`` of a listener batch's claims."""
        if not items:
            return []
        return await self._run(self._complete_keys_op, group, items, retention_s)

    def _complete_keys_op(self, cur: Any, now: float, *args: Any) -> list[bool]:
        return self._complete_keys_merged(cur, now, [args])[0]

    def _complete_keys_merged(self, cur: Any, now: float, ops: list[tuple[Any, ...]]
                              ) -> list[list[bool]]:
        """The completions of several listener batches in one statement: every row still
        ``CONSUMING`` under exactly a claim's (group, topic, key, owner) turns
        ``CONSUMED``. When it changed one row per claim, every claim won; otherwise each
        batch is completed again by the full rule (``_complete_tx``), which counts a row
        already ``CONSUMED`` by its owner as won and fences off the stale owners."""
        rows = []
        for group, items, retention_s in ops:
            expires_at = now + retention_s
            rows += [(group, t, k, o, expires_at) for t, k, o, _ in items]
        if self._update_completed(cur, now, rows) == len(rows):
            return [[True] * len(items) for _, items, _ in ops]
        return [self._complete_tx(cur, now, [Ticket(group, t, k, o) for t, k, o, _ in items],
                                  retention_s) for group, items, retention_s in ops]

    def _update_completed(self, cur: Any, now: float, rows: list[tuple[Any, ...]]) -> int:
        """Mark ``CONSUMED`` the ``CONSUMING`` rows of (group, topic, key, owner, expiry)
        ``rows``; the number of rows changed."""
        d = self.dialect
        hist, hparams = self._event("completed", now)
        sets = f"{hist}, status = ?, updated_at = ?, expires_at = "
        done, consuming = Status.CONSUMED.value, Status.CONSUMING.value
        rows.sort()  # the same lock order in every transaction
        if d.array_in:  # one statement whatever the number of rows
            source, params = self._rows(5, rows, ("text", "text", "text", "text", "float8"))
            cur.execute(self._sql(
                f"UPDATE {{t}} AS d SET {sets}u.ex FROM "
                f"({source}) AS u(g, tp, k, o, ex) WHERE d.grp = u.g AND d.topic = u.tp AND "
                "d.dkey = u.k AND d.owner = u.o AND d.status = ? AND d.expires_at > ?"),
                (*hparams, done, now, *params, consuming, now))
            return cur.rowcount
        changed = 0
        by_expiry: dict[float, list[tuple[Any, ...]]] = defaultdict(list)
        for r in rows:  # one expiry per retention: one group in the usual case
            by_expiry[r[4]].append(r)
        for expires_at, group in by_expiry.items():
            for i in range(0, len(group), 500):
                part = group[i:i + 500]
                keys = ", ".join(["(?, ?, ?, ?)"] * len(part))
                owners: list[Any] = []
                if d.row_values_in:  # SQLite: the owner index finds the rows
                    where = (f"owner IN ({self._marks(len(part))}) AND (grp, topic, dkey, "
                             f"owner) IN (VALUES {keys})")
                    owners = [r[3] for r in part]
                else:  # MariaDB/MySQL: a range of the primary key per row
                    where = f"(grp, topic, dkey, owner) IN ({keys})"
                cur.execute(self._sql(
                    f"UPDATE {{t}} SET {sets}? WHERE {where} AND status = ? AND "
                    "expires_at > ?"),
                    (*hparams, done, now, expires_at, *owners,
                     *[v for r in part for v in r[:4]], consuming, now))
                changed += cur.rowcount
        return changed

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

    # ------------------------------------------------------------------ replies
    async def put_replies(self, group: str, items: Sequence[tuple[str, str, str, bytes]]
                          ) -> list[bool]:
        """``replies.put_replies``: each reply into its record while the owner token holds
        its ``CONSUMING`` claim (one statement per reply, in one transaction)."""
        if not items:
            return []
        return await self._run(self._put_replies_tx, group, list(items))

    def _put_replies_tx(self, cur: Any, now: float, group: str,
                        items: list[tuple[str, str, str, bytes]]) -> list[bool]:
        out = [False] * len(items)
        sql = self._sql("UPDATE {t} SET reply = ? WHERE grp = ? AND topic = ? AND dkey = ? "
                        "AND owner = ? AND status = ? AND expires_at > ?")
        for i in sorted(range(len(items)), key=lambda i: items[i][:2]):  # the lock order
            topic, key, owner, reply = items[i]
            cur.execute(sql, (bytes(reply), group, topic, key, owner,
                              Status.CONSUMING.value, now))
            out[i] = cur.rowcount == 1
        return out

    async def get_replies(self, group: str, keys: Sequence[tuple[str, str]]
                          ) -> list[bytes | None]:
        """``replies.get_replies``: the reply kept in each ``CONSUMED`` record."""
        if not keys:
            return []

        def tx(cur: Any, now: float) -> list[bytes | None]:
            out: list[bytes | None] = []
            sql = self._sql("SELECT reply FROM {t} WHERE grp = ? AND topic = ? AND dkey = ? "
                            "AND status = ? AND expires_at > ?")
            for topic, key in keys:
                cur.execute(sql, (group, topic, key, Status.CONSUMED.value, now))
                row = cur.fetchone()
                out.append(None if row is None or row[0] is None else bytes(row[0]))
            return out

        return await self._run(tx)

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
