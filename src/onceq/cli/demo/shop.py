"""The demo's business (seed 002's my_order / my_inv): an order decrements inventory.

One SQLite file shared by every member process. Applying an order is one transaction:
insert its row in ``my_order`` and decrement its item in ``my_inv``. ``my_order`` has no
unique constraint on purpose: an order applied twice shows up as two rows and a double
decrement, which is what the contrast run (protections off) measures.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

ITEMS = [f"sku-{i}" for i in range(8)]
INITIAL_STOCK = 10_000_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS my_inv (item TEXT PRIMARY KEY, stock INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS my_order (
    order_id TEXT NOT NULL, unique_key TEXT NOT NULL, item TEXT NOT NULL,
    qty INTEGER NOT NULL, member TEXT NOT NULL, delivery TEXT NOT NULL, t REAL NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class Order:
    """An order event; its body is what the Spark pipeline reads (``spark.orders``)."""

    order_id: str
    item: str
    qty: int
    event_time: str  # ISO 8601, UTC

    def body(self) -> bytes:
        return json.dumps({"order_id": self.order_id, "product": self.item,
                           "quantity": self.qty, "event_time": self.event_time},
                          separators=(",", ":")).encode()

    @staticmethod
    def parse(body: bytes) -> Order:
        d = json.loads(body)
        return Order(d["order_id"], d["product"], int(d["quantity"]), d["event_time"])


def make_orders(n: int, seed: int) -> list[Order]:
    rnd = random.Random(seed)
    start = datetime.now(UTC).replace(microsecond=0)
    return [Order(f"o-{i:07d}", rnd.choice(ITEMS), rnd.randint(1, 5),
                  (start + timedelta(milliseconds=i)).isoformat(timespec="milliseconds")
                  .replace("+00:00", "Z"))
            for i in range(n)]


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def create(path: str) -> None:
    conn = connect(path)
    conn.executescript(_SCHEMA)
    conn.executemany("INSERT OR IGNORE INTO my_inv VALUES (?, ?)",
                     [(item, INITIAL_STOCK) for item in ITEMS])
    conn.close()


class Shop:
    """Applies orders; one connection per thread (listeners run in worker threads)."""

    def __init__(self, path: str, member: str) -> None:
        self.path = path
        self.member = member
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path)
        return conn

    def apply(self, rows: list[tuple[Order, str, str]]) -> None:
        """Apply (order, unique key, delivery id) rows in one transaction."""
        conn = self._conn()
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for order, unique_key, delivery in rows:
                conn.execute("INSERT INTO my_order VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (order.order_id, unique_key, order.item, order.qty, self.member,
                              delivery, now))
                conn.execute("UPDATE my_inv SET stock = stock - ? WHERE item = ?",
                             (order.qty, order.item))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def applied(self, order_id: str) -> bool:
        """The business system's answer to "was this order done?" (reconciliation)."""
        row = self._conn().execute("SELECT 1 FROM my_order WHERE order_id = ? LIMIT 1",
                                   (order_id,)).fetchone()
        return row is not None


def read_effects(path: str) -> tuple[list[tuple[str, str, str, float]], dict[str, int]]:
    """(order id, unique key, delivery id, time) of every applied effect, and the stock."""
    conn = connect(path)
    rows = conn.execute("SELECT order_id, unique_key, delivery, t FROM my_order").fetchall()
    stock = dict(conn.execute("SELECT item, stock FROM my_inv").fetchall())
    conn.close()
    return rows, stock
