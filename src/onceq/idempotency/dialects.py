"""SQL dialects of the dedup stores: how to connect, the schema, the few statements that
differ between SQLite, MariaDB/MySQL (PyMySQL) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from .record import HISTORY_CHARS
from .store import StoreError

__all__ = ["COLS", "ROW", "Dialect", "dialect_for_url", "mysql_dialect", "postgres_dialect",
           "sqlite_dialect"]

COLS = ("grp, topic, dkey, status, owner, attempt, lease_until, payload_hash, created_at, "
        "updated_at, expires_at, history")


@dataclass
class Dialect:
    name: str
    connect: Callable[[], Any]  # a new DB-API connection
    schema: Callable[[str], list[str]]  # CREATE statements for a table name
    insert_absent: str  # INSERT of one row that does nothing if the key exists ({t})
    purge: str  # delete up to ? expired rows ({t}; params: now, limit)
    lock: str = " FOR UPDATE"
    begin: str | None = None  # statement opening a write transaction (None: implicit)
    param: str = "%s"
    pool_size: int = 4
    is_transient: Callable[[BaseException], bool] = lambda exc: False
    errors: tuple[type[BaseException], ...] = ()
    sync_connect: Callable[[str], Callable[[], Any]] = lambda level: lambda: None
    # arrays as parameters (PostgreSQL): ``= ANY(array)`` instead of ``IN (...)``, and
    # rows given as one array per column (``unnest``) instead of ``VALUES (...), ...``: the
    # statement text then stays the same whatever the batch size, short enough for the
    # driver to cache its parsing and prepare it once
    array_in: bool = False
    # the SQL types of the table's columns (COLS), for arrays of rows
    column_types: tuple[str, ...] = ()
    # the rowcount of ``insert_absent`` counts the rows inserted, not those already there
    # (MySQL's ``INSERT IGNORE`` counts inserted rows; ``ON DUPLICATE KEY UPDATE`` with
    # FOUND_ROWS would count the rows found too)
    counts_inserts: bool = False
    # ``(a, b) IN (VALUES (?, ?), ...)`` works and uses the index of the other condition
    row_values_in: bool = False
    # ``history = <history with a line appended>``; the line is the SQL expressions given
    history_set: Callable[[list[str]], str] = lambda parts: (
        f"history = substr(COALESCE(history, '') || {' || '.join(parts)}, -{HISTORY_CHARS})")
    int_text: str = "CAST(attempt AS TEXT)"
    # the error says that the database-wide write lock was not obtained in time (SQLite):
    # another connection holds it; trying again at once would only wait again
    is_lock_timeout: Callable[[BaseException], bool] = lambda exc: False
    database: str = ""  # the database, as log lines name it
    busy_timeout_s: float | None = None  # SQLite: how long a writer waits for the lock
    # the listener's completions and claims of a group in one round trip (``SqlStore.
    # _one_trip``): PostgreSQL, and MariaDB/MySQL on connections that allow several
    # statements per call
    one_trip: bool = False


def _schema(double: str, key: str, text: str, extra: str = "", inline_index: bool = False
            ) -> Callable[[str], list[str]]:
    def make(t: str) -> list[str]:
        idx = (f", INDEX {t}_owner (owner), INDEX {t}_expires (expires_at)"
               if inline_index else "")
        stmts = [f"CREATE TABLE IF NOT EXISTS {t} (grp {key} NOT NULL, topic {key} NOT NULL, "
                 f"dkey {text} NOT NULL, status VARCHAR(10) NOT NULL, owner VARCHAR(100) NOT "
                 f"NULL, attempt INTEGER NOT NULL, lease_until {double} NOT NULL, payload_hash "
                 f"VARCHAR(64) NOT NULL, created_at {double} NOT NULL, updated_at {double} NOT "
                 f"NULL, expires_at {double} NOT NULL, history TEXT, "
                 f"PRIMARY KEY (grp, topic, dkey){idx})"
                 f"{extra}"]
        if not inline_index:
            stmts += [f"CREATE INDEX IF NOT EXISTS {t}_owner ON {t} (owner)",
                      f"CREATE INDEX IF NOT EXISTS {t}_expires ON {t} (expires_at)"]
        return stmts
    return make


ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT = f"INSERT INTO {{t}} ({COLS}) VALUES {ROW}"


def _sqlite_lock_timeout(exc: BaseException) -> bool:
    import sqlite3

    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "database is locked" in str(exc) or "database is busy" in str(exc)


def sqlite_dialect(path: str, synchronous: str = "FULL", busy_timeout_s: float = 10.0
                   ) -> Dialect:
    """SQLite in WAL mode (a file shared by the processes of one host, or ``:memory:``).
    ``synchronous=FULL`` survives a power cut; ``NORMAL`` (faster: no fsync per commit)
    survives a crash of the process but may lose the last records in a power cut.
    ``busy_timeout_s``: how long a connection waits for the write lock that another one
    holds before the statement fails with "database is locked"."""
    import os
    import sqlite3

    if busy_timeout_s <= 0:
        raise ValueError("busy_timeout_s must be > 0")
    memory = path == ":memory:"

    def connector(level: str) -> Callable[[], Any]:
        def connect() -> Any:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=busy_timeout_s)
            if not memory:
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={level}")
            return conn
        return connect

    return Dialect("sqlite", connector(synchronous), _schema("REAL", "TEXT", "TEXT"),
                   _INSERT + " ON CONFLICT DO NOTHING",
                   "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE expires_at <= ? "
                   "LIMIT ?)", lock="", begin="BEGIN IMMEDIATE", param="?",
                   pool_size=1,  # writers are serialised by the database anyway
                   is_transient=lambda exc: "locked" in str(exc) or "busy" in str(exc),
                   errors=(sqlite3.Error,), sync_connect=connector, counts_inserts=True,
                   row_values_in=True, is_lock_timeout=_sqlite_lock_timeout,
                   database=path if memory else os.path.abspath(path),
                   busy_timeout_s=busy_timeout_s)


def mysql_dialect(url: SplitResult, multi_statements: bool = False) -> Dialect:
    """MariaDB or MySQL through PyMySQL, READ COMMITTED, keys compared byte for byte.
    ``multi_statements``: the connections accept several statements per call (the dedup
    store's own connections, for one round trip per group; never the connections handed
    to a transactional handler)."""
    try:
        import pymysql
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("the MySQL dedup store needs PyMySQL: pip install "
                          "'onceq[idempotency]'") from exc

    def connect() -> Any:
        try:
            conn = pymysql.connect(host=url.hostname or "127.0.0.1", port=url.port or 3306,
                                   user=unquote(url.username or "root"),
                                   password=unquote(url.password or ""),
                                   database=url.path.lstrip("/") or None, charset="utf8mb4",
                                   autocommit=False, connect_timeout=5, read_timeout=30,
                                   write_timeout=30,  # rowcount = rows matched:
                                   client_flag=pymysql.constants.CLIENT.FOUND_ROWS | (
                                       pymysql.constants.CLIENT.MULTI_STATEMENTS
                                       if multi_statements else 0))
        except pymysql.Error as exc:
            raise StoreError(f"mysql dedup store: cannot connect: {exc}") from exc
        with conn.cursor() as cur:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cur.execute("SET SESSION innodb_lock_wait_timeout = 10")
        return conn

    def transient(exc: BaseException) -> bool:  # a lock wait timeout is an error
        return bool(exc.args) and exc.args[0] == 1213  # deadlock: retried

    return Dialect("mysql", connect,
                   _schema("DOUBLE", "VARCHAR(128)", "VARCHAR(255)",
                           " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
                           inline_index=True),
                   # IGNORE: the rowcount is the rows inserted (with FOUND_ROWS, the
                   # no-op ON DUPLICATE KEY UPDATE counted the rows found too); every value
                   # is checked against its column before, so only duplicate keys are ignored
                   _INSERT.replace("INSERT INTO", "INSERT IGNORE INTO"),
                   "DELETE FROM {t} WHERE expires_at <= ? LIMIT ?",
                   is_transient=transient, errors=(pymysql.Error,), counts_inserts=True,
                   history_set=lambda parts: (
                       f"history = RIGHT(CONCAT(COALESCE(history, ''), {', '.join(parts)}), "
                       f"{HISTORY_CHARS})"),
                   int_text="CAST(attempt AS CHAR)", one_trip=multi_statements)


def postgres_dialect(url: SplitResult) -> Dialect:
    """PostgreSQL through psycopg 3, READ COMMITTED."""
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("the PostgreSQL dedup store needs psycopg: pip install "
                          "'onceq[idempotency]'") from exc
    conninfo = url._replace(scheme="postgresql", query="", fragment="").geturl()

    def connect() -> Any:
        try:
            return psycopg.connect(conninfo, autocommit=False, connect_timeout=5,
                                   options="-c lock_timeout=10s")
        except psycopg.Error as exc:
            raise StoreError(f"postgresql dedup store: cannot connect: {exc}") from exc

    def transient(exc: BaseException) -> bool:  # a lock timeout is an error, not retried
        return isinstance(exc, psycopg.errors.DeadlockDetected
                          | psycopg.errors.SerializationFailure)

    return Dialect("postgresql", connect,
                   _schema("DOUBLE PRECISION", "VARCHAR(128)", "VARCHAR(255)"),
                   _INSERT + " ON CONFLICT DO NOTHING",
                   "DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM {t} WHERE expires_at <= ? "
                   "LIMIT ?)", is_transient=transient, errors=(psycopg.Error,),
                   # binary parameters: no text escaping of every array element
                   array_in=True, counts_inserts=True, row_values_in=True, param="%b",
                   one_trip=True,
                   column_types=("text", "text", "text", "text", "text", "int", "float8",
                                 "text", "float8", "float8", "float8", "text"),
                   history_set=lambda parts: (
                       f"history = right(COALESCE(history, '') || {' || '.join(parts)}, "
                       f"{HISTORY_CHARS})"))


def dialect_for_url(url: str, *, memory_ok: bool = True,
                    busy_timeout_s: float | None = None) -> Dialect:
    """The dialect of a database URL: ``sqlite:///relative.db``, ``sqlite:////abs.db``
    (``sqlite://`` or ``sqlite:///:memory:`` when ``memory_ok``),
    ``mysql://user@host:port/db`` (or ``mariadb://``), ``postgresql://user@host:port/db``.
    ``busy_timeout_s``: SQLite's wait for the write lock (None: ``sqlite_dialect``'s).
    ValueError for another scheme, or an in-memory SQLite database where it is refused."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        path = url.split("://", 1)[1].split("?", 1)[0]
        path = (path[1:] if path.startswith("/") else path) or ":memory:"
        if path == ":memory:" and not memory_ok:
            raise ValueError(f"{url!r}: a database file is needed (sqlite:///name.db), not "
                             "an in-memory database")
        if busy_timeout_s is None:
            return sqlite_dialect(path)
        return sqlite_dialect(path, busy_timeout_s=busy_timeout_s)
    if scheme in ("mysql", "mariadb", "mysql+pymysql"):
        return mysql_dialect(parts)
    if scheme in ("postgresql", "postgres"):
        return postgres_dialect(parts)
    raise ValueError(f"unknown database URL scheme {scheme!r} in {url!r}: use sqlite, "
                     "postgresql or mysql")
