"""SQLAlchemy in the transactional mode: ``transactional(handler, db=engine)``.

The batch runs on a SQLAlchemy ``Connection`` of the user's ``Engine``, inside one
``Connection.begin()``: the dedup rows go in through the connection's driver (the same
statements as with a plain DB-API connection) and the handler gets that ``Connection``, or
with ``session=True`` a ``Session`` joined to it (under a savepoint of its own, committed
into the batch's transaction after the handler). One commit makes everything durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .store import StoreError

__all__ = ["SaCursor", "engine_url", "in_session", "is_engine", "run_in_sa_transaction"]


def is_engine(db: Any) -> bool:
    try:
        from sqlalchemy.engine import Engine
    except ImportError:  # pragma: no cover - depends on the installation
        return False
    return isinstance(db, Engine)


def engine_url(engine: Any) -> str:
    """The engine's database as a dedup URL (``sqlite:///...``, ``postgresql://...``,
    ``mysql://...``): the table is created and purged through it."""
    url = engine.url
    backend = url.get_backend_name()
    if backend == "sqlite":
        return f"sqlite:///{url.database or ''}"
    scheme = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql"}.get(backend)
    if scheme is None:
        raise ValueError(f"transactional mode needs sqlite, mysql or postgresql, not "
                         f"{backend!r}")
    return url.set(drivername=scheme).render_as_string(hide_password=False)


class SaCursor:
    """The few DB-API cursor calls the batch makes, on a SQLAlchemy ``Connection`` (the
    driver's own parameter style: ``?`` for SQLite, ``%s`` for psycopg and PyMySQL).
    ``connection`` is what the handler receives."""

    def __init__(self, conn: Any) -> None:
        self.connection = conn
        self._result: Any = None
        self.rowcount = -1

    def execute(self, sql: str, params: Any = ()) -> None:
        self._result = self.connection.exec_driver_sql(sql, tuple(params))
        self.rowcount = self._result.rowcount

    def fetchone(self) -> Any:
        return self._result.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._result.fetchall())


def run_in_sa_transaction(engine: Any, begin: str | None, fn: Callable[..., Any], now: float,
                          *args: Any) -> Any:
    """``fn(cursor, now, *args)`` in one transaction on a connection of ``engine``."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with engine.connect() as conn, conn.begin():
            if begin:  # SQLite: take the write lock now (BEGIN IMMEDIATE)
                conn.exec_driver_sql(begin)
            return fn(SaCursor(conn), now, *args)
    except SQLAlchemyError as exc:
        raise StoreError(f"transactional batch (SQLAlchemy): {type(exc).__name__}: {exc}"
                         ) from exc


def in_session(handler: Callable[[Any, Any], None], m: Any, conn: Any) -> None:
    """``handler(m, session)`` on a ``Session`` joined to the batch's connection: its
    changes are flushed and kept in the batch's transaction; on failure they are rolled
    back (the session's savepoint) and the exception goes on."""
    from sqlalchemy.orm import Session

    with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
        handler(m, session)
        session.commit()  # releases the session's savepoint, not the batch's transaction
