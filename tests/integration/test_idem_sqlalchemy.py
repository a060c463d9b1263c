"""Transactional mode with SQLAlchemy 2.x on SQLite and PostgreSQL (and MariaDB): the
handler gets a ``Connection`` or a ``Session``; its writes and the dedup rows commit in one
transaction, a failing handler's writes vanish with its savepoint, duplicates do nothing."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, func, select, text
from sqlalchemy.orm import DeclarativeBase

from onceq.client.allocation import MessageQueue
from onceq.client.push import ConsumeContext, ConsumeStatus
from onceq.idempotency import transactional
from onceq.log.record import MessageExt
from tests.integration.test_idem_stores import require_server

MQ = MessageQueue("orders", 0)
DRIVERS = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def shop(request, tmp_path):
    kind = request.param
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/shop.db"
    else:
        url = require_server(kind).replace(kind, DRIVERS[kind], 1)
    engine = create_engine(url)
    uid = uuid.uuid4().hex[:10]
    meta = MetaData()
    effects = Table(f"eff_{uid}", meta, Column("id", Integer, primary_key=True),
                    Column("k", String(64), nullable=False))
    meta.create_all(engine)
    yield engine, effects, f"onceq_done_{uid}"
    meta.drop_all(engine)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS onceq_done_{uid}"))
    engine.dispose()


def msgs(*ids: int) -> list[MessageExt]:
    return [MessageExt("orders", 0, i, f"order {i}".encode(), f"U{i}") for i in ids]


async def call(listener, batch):
    ctx = ConsumeContext(MQ, len(batch) - 1, group="billing")
    status = await listener(batch, ctx)
    return status, ctx.ack_index, ctx.delay_level


def counts(engine, effects) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(select(effects.c.k, func.count()).group_by(effects.c.k)).all())


def done_rows(engine, table: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()


async def test_connection_handler_commits_with_the_dedup_rows(shop):
    engine, effects, table = shop
    seen: list[type] = []
    fail_on = {"U2"}

    def handle(m, conn):
        seen.append(type(conn))
        conn.execute(effects.insert().values(k=m.unique_key))
        if m.unique_key in fail_on:
            raise RuntimeError("stock service refused")  # after a write: rolled back

    lst = transactional(handle, db=engine, table=table)
    try:
        assert await call(lst, msgs(0, 1, 2, 3)) == (ConsumeStatus.SUCCESS, 1, 0)
        assert counts(engine, effects) == {"U0": 1, "U1": 1}
        assert done_rows(engine, table) == 2  # U2's row vanished with its savepoint
        fail_on.clear()
        assert await call(lst, msgs(0, 1, 2, 3)) == (ConsumeStatus.SUCCESS, 3, 0)
        assert counts(engine, effects) == {f"U{i}": 1 for i in range(4)}
        assert lst.stats["handled"] == 4 and lst.stats["duplicate"] == 2
        assert {t.__name__ for t in seen} == {"Connection"}
    finally:
        await lst.close()


async def test_session_handler_and_two_consumers_racing(shop):
    engine, effects, table = shop

    class Base(DeclarativeBase):
        pass

    class Effect(Base):
        __table__ = effects

    def handle(m, session):
        session.add(Effect(k=m.unique_key))
        if m.unique_key == "U5" and session.scalar(select(func.count()).select_from(
                effects).where(effects.c.k == "U5")) == 1:  # flushed, visible inside
            raise RuntimeError("after the flush: rolled back")

    a = transactional(handle, db=engine, table=table, session=True)
    b = transactional(handle, db=engine, table=table, session=True)
    try:
        assert await call(a, msgs(4, 5, 6)) == (ConsumeStatus.SUCCESS, 0, 0)
        assert counts(engine, effects) == {"U4": 1}
        for i in range(7, 37):
            results = await asyncio.gather(call(a, msgs(i)), call(b, msgs(i)))
            assert all(r == (ConsumeStatus.SUCCESS, 0, 0) for r in results), (i, results)
        got = counts(engine, effects)
        assert len(got) == 31 and set(got.values()) == {1}
        assert done_rows(engine, table) == 31
        assert a.stats["handled"] + b.stats["handled"] == 31
    finally:
        await a.close()
        await b.close()


def test_session_mode_needs_an_engine(tmp_path):
    with pytest.raises(ValueError, match="session=True needs a SQLAlchemy Engine"):
        transactional(lambda m, s: None, db=f"sqlite:///{tmp_path}/x.db", session=True)


async def test_sqlite_engine_a_held_write_lock_fails_the_batch_as_a_lock_timeout(tmp_path):
    """With an Engine the engine's own busy timeout applies (here 0.2 s); the batch fails
    with the same retriable lock timeout as with a URL, and runs once the lock is free."""
    import sqlite3

    engine = create_engine(f"sqlite:///{tmp_path}/shop.db", connect_args={"timeout": 0.2})
    meta = MetaData()
    effects = Table("eff", meta, Column("id", Integer, primary_key=True),
                    Column("k", String(64), nullable=False))
    meta.create_all(engine)
    lst = transactional(lambda m, conn: conn.execute(effects.insert().values(k=m.unique_key)),
                        db=engine)
    holder = sqlite3.connect(tmp_path / "shop.db", isolation_level=None)
    try:
        assert await call(lst, msgs(0)) == (ConsumeStatus.SUCCESS, 0, 0)
        holder.execute("BEGIN IMMEDIATE")
        blocked = await call(lst, msgs(1))
        holder.execute("ROLLBACK")
        again = await call(lst, msgs(1))
    finally:
        holder.close()
        await lst.close()
        engine.dispose()
    assert blocked == (ConsumeStatus.RECONSUME_LATER, 0, 0)
    assert (lst.stats["lock_timeouts"], lst.stats["failed"]) == (1, 0)
    assert again == (ConsumeStatus.SUCCESS, 0, 0)
