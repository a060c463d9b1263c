"""The exactly-once pipeline's database side: per-product inventory totals, the orders
already counted and the micro-batches already applied, changed together in one
transaction per micro-batch (no pyspark here).

Tables (``<prefix>_...``, created on first use):

* ``batches`` (query id, batch id): one row per applied micro-batch. It is inserted first
  in the batch's transaction; a row already there means the batch was applied before (a
  replay after a restart or a failure between the database commit and Spark's commit),
  and the transaction is rolled back with nothing changed.
* ``orders`` (order id): every order counted, with the batch that counted it. An order id
  already there is a duplicate, whatever the time since the first copy.
* ``inventory`` (product): ordered quantity and order count, incremented by the batch.

SQLite, MariaDB/MySQL and PostgreSQL, through the idempotency layer's dialects.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..idempotency.dialects import Dialect, dialect_for_url
from ..idempotency.store import check_name

__all__ = ["BatchOutcome", "InventoryStore", "ProductTotal", "open_dialect"]

_TRIES = 5  # deadlocks and serialisation failures are retried
MAX_ID_CHARS = 255  # order ids and product names: longer ones are malformed input


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    replayed: bool  # the batch had been applied before: nothing changed
    orders_new: int  # orders counted by this batch
    late_duplicates: int  # orders of the batch counted before (by an earlier batch)
    products: int  # inventory rows changed


@dataclass(frozen=True, slots=True)
class ProductTotal:
    quantity: int
    orders: int


def open_dialect(url: str) -> Dialect:
    """The dialect for a database URL: ``sqlite:///relative.db``, ``sqlite:////abs.db``,
    ``postgresql://user@host:port/db``, ``mysql://user@host:port/db`` (or ``mariadb://``)."""
    return dialect_for_url(url, memory_ok=False)


class InventoryStore:
    """The pipeline's tables in one database; one connection, used from one thread."""

    def __init__(self, url: str, prefix: str = "onceq_pipeline") -> None:
        self.dialect = open_dialect(url)
        prefix = check_name(prefix)
        self.batches_t = f"{prefix}_batches"
        self.orders_t = f"{prefix}_orders"
        self.inventory_t = f"{prefix}_inventory"
        self._conn: Any = None
        mysql = self.dialect.name == "mysql"
        ignore, nothing = ("INSERT IGNORE INTO", "") if mysql else (
            "INSERT INTO", " ON CONFLICT DO NOTHING")
        self._insert_batch = self._sql(
            f"{ignore} {self.batches_t} (query_id, batch_id, orders_in, orders_new, "
            f"committed_at) VALUES (?, ?, ?, 0, ?){nothing}")
        self._count_batch = self._sql(
            f"UPDATE {self.batches_t} SET orders_new = ? WHERE query_id = ? AND batch_id = ?")
        self._insert_order = self._sql(
            f"{ignore} {self.orders_t} (order_id, product, quantity, query_id, batch_id) "
            f"VALUES (?, ?, ?, ?, ?){nothing}")
        self._new_orders = self._sql(
            f"SELECT product, SUM(quantity), COUNT(*) FROM {self.orders_t} WHERE query_id = ? "
            "AND batch_id = ? GROUP BY product")
        t = self.inventory_t
        head = f"INSERT INTO {t} (product, quantity, orders, updated_at) VALUES (?, ?, ?, ?)"
        self._upsert = self._sql(
            head + " ON DUPLICATE KEY UPDATE quantity = quantity + VALUES(quantity), "
            "orders = orders + VALUES(orders), updated_at = VALUES(updated_at)" if mysql else
            head + f" ON CONFLICT (product) DO UPDATE SET quantity = {t}.quantity + "
            f"excluded.quantity, orders = {t}.orders + excluded.orders, "
            "updated_at = excluded.updated_at")

    def _sql(self, text: str) -> str:
        return text.replace("?", self.dialect.param)

    def _schema(self) -> list[str]:
        name = self.dialect.name
        key = "TEXT" if name == "sqlite" else f"VARCHAR({MAX_ID_CHARS})"
        qid = "TEXT" if name == "sqlite" else "VARCHAR(64)"
        double = {"sqlite": "REAL", "postgresql": "DOUBLE PRECISION"}.get(name, "DOUBLE")
        extra = (" ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                 if name == "mysql" else "")
        idx = f", INDEX {self.orders_t}_batch (query_id, batch_id)" if name == "mysql" else ""
        stmts = [
            f"CREATE TABLE IF NOT EXISTS {self.batches_t} (query_id {qid} NOT NULL, batch_id "
            f"BIGINT NOT NULL, orders_in BIGINT NOT NULL, orders_new BIGINT NOT NULL, "
            f"committed_at {double} NOT NULL, PRIMARY KEY (query_id, batch_id)){extra}",
            f"CREATE TABLE IF NOT EXISTS {self.orders_t} (order_id {key} NOT NULL PRIMARY KEY, "
            f"product {key} NOT NULL, quantity BIGINT NOT NULL, query_id {qid} NOT NULL, "
            f"batch_id BIGINT NOT NULL{idx}){extra}",
            f"CREATE TABLE IF NOT EXISTS {self.inventory_t} (product {key} NOT NULL PRIMARY "
            f"KEY, quantity BIGINT NOT NULL, orders BIGINT NOT NULL, updated_at {double} "
            f"NOT NULL){extra}",
        ]
        if name != "mysql":
            stmts.append(f"CREATE INDEX IF NOT EXISTS {self.orders_t}_batch ON "
                         f"{self.orders_t} (query_id, batch_id)")
        return stmts

    def _connection(self) -> Any:
        if self._conn is None:
            conn = self.dialect.connect()
            try:
                cur = conn.cursor()
                for stmt in self._schema():
                    cur.execute(stmt)
                conn.commit()
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to do
                conn.close()

    def apply_batch(self, query_id: str, batch_id: int,
                    orders: Sequence[tuple[str, str, int]] | None = None,
                    totals: Sequence[tuple[str, int, int]] | None = None) -> BatchOutcome:
        """Apply one micro-batch in one transaction, once per (query id, batch id).

        ``orders`` (order id, product, quantity): each order id is counted at most once
        ever (the orders table). Or ``totals`` (product, quantity, orders) already summed,
        added as given (no orders table: exact only for what Spark dropped)."""
        if (orders is None) == (totals is None):
            raise ValueError("apply_batch: give orders or totals")
        d = self.dialect
        for attempt in range(_TRIES):
            conn = self._connection()
            try:
                cur = conn.cursor()
                if d.begin:
                    cur.execute(d.begin)
                now = time.time()
                n_in = len(orders) if orders is not None else sum(t[2] for t in totals or ())
                cur.execute(self._insert_batch, (query_id, batch_id, n_in, now))
                if cur.rowcount == 0:  # applied before: change nothing
                    conn.rollback()
                    return BatchOutcome(True, 0, 0, 0)
                if orders is not None:
                    if orders:
                        cur.executemany(self._insert_order,
                                        [(o, p, int(q), query_id, batch_id)
                                         for o, p, q in orders])
                    cur.execute(self._new_orders, (query_id, batch_id))
                    deltas = [(p, int(q), int(n)) for p, q, n in cur.fetchall()]
                else:
                    deltas = [(p, int(q), int(n)) for p, q, n in totals or () if n]
                if deltas:
                    cur.executemany(self._upsert, [(p, q, n, now) for p, q, n in deltas])
                new = sum(n for _p, _q, n in deltas)
                cur.execute(self._count_batch, (new, query_id, batch_id))
                conn.commit()
                return BatchOutcome(False, new, n_in - new, len(deltas))
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    conn.rollback()
                if isinstance(exc, d.errors):
                    if d.is_transient(exc) and attempt < _TRIES - 1:
                        continue
                    self._drop()
                raise
        raise AssertionError("unreachable")

    def totals(self) -> dict[str, ProductTotal]:
        """Per-product totals as committed."""
        return {p: ProductTotal(int(q), int(n)) for p, q, n in self._read(
            f"SELECT product, quantity, orders FROM {self.inventory_t} ORDER BY product")}

    def applied_batches(self, query_id: str) -> list[int]:
        return [int(b) for (b,) in self._read(self._sql(
            f"SELECT batch_id FROM {self.batches_t} WHERE query_id = ? ORDER BY batch_id"),
            (query_id,))]

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        conn = self._connection()
        try:
            cur = conn.cursor()
            cur.execute(sql, params)
            rows = [tuple(r) for r in cur.fetchall()]
            conn.commit()  # end the read transaction (PostgreSQL, MySQL)
            return rows
        except self.dialect.errors:
            self._drop()
            raise

    def drop_tables(self) -> None:
        """Delete the pipeline's tables (and everything they hold)."""
        conn = self._connection()
        cur = conn.cursor()
        for t in (self.batches_t, self.orders_t, self.inventory_t):
            cur.execute(f"DROP TABLE IF EXISTS {t}")
        conn.commit()
        self._drop()

    def close(self) -> None:
        self._drop()
