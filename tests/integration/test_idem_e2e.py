"""End to end over a real broker: idempotent consumers join and leave, one is SIGKILLed,
handlers fail now and then; every order's effect happens exactly once.

50,000 orders (``ONCEQ_E2E_ORDERS``), listener batches of 32: a failing order ends its
batch's handler, which acknowledges the orders before it (``ack_index``), as a batch
handler with partial effects must. Members B, C and D run in this process, A in a child
process that is killed mid-stream.
Effects are rows (one per handling) counted after the run; nothing is asserted inside a
listener. Non-transactional stores use the reconcile callback (the effects table answers
"was it done?"), which is how the window between an effect and its CONSUMED record is
closed without a transaction; the transactional mode needs no callback.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid

import pytest

from onceq import Admin, Producer
from onceq.client.push import ConsumeStatus, PushConsumer
from onceq.idempotency import idempotent, open_store, transactional
from tests.helpers import running_broker
from tests.idem_consumer_proc import Effects
from tests.integration.test_idem_consumer import effect_counts, start_child
from tests.integration.test_idem_stores import require_server
from tests.integration.test_idem_transactional import Db
from tests.integration.test_push_consumer import wait_until

N = int(os.environ.get("ONCEQ_E2E_ORDERS", "50000"))
BATCH = 32  # messages per listener call
LEVELS = " ".join(["200ms"] * 18)


def injected_failure(m) -> bool:
    """About one order in 20 fails on its first delivery (before any effect)."""
    return m.reconsume_times == 0 and int(m.unique_key[-4:], 16) % 20 == 0


@pytest.mark.parametrize("mode", ["sqlite", "redis", "tx_postgresql"])
@pytest.mark.slow
async def test_members_join_leave_one_killed_failures_injected_effects_exactly_once(
        tmp_path, mode):
    group = "billing"
    table = f"onceq_e_{uuid.uuid4().hex[:10]}"
    failures = {"n": 0}
    closers = []
    listeners: list = []
    if mode == "tx_postgresql":
        db = Db("postgresql", tmp_path)
        db.create()
        child_args = ["--transactional", db.effects]
        child_effects = tmp_path / "child.db"  # unused: effects are rows in PostgreSQL
        url, child_table = db.url, db.table

        def count() -> dict[str, int]:
            return db.counts()

        def progress() -> int:
            return db.sql(f"SELECT COUNT(DISTINCT k) FROM {db.effects}")[0][0]

        def by_pid(pid: int) -> int:
            return db.sql(f"SELECT COUNT(*) FROM {db.effects} WHERE pid = {pid}")[0][0]

        def make_listener():
            def handle(m, conn):
                if injected_failure(m):
                    failures["n"] += 1
                    raise RuntimeError("injected failure")
                conn.cursor().execute(f"INSERT INTO {db.effects} (k, pid) VALUES (%s, 0)",
                                      (m.unique_key,))
            lst = transactional(handle, db=url, table=db.table)
            closers.append(lst.close)
            listeners.append(lst)
            return lst
    else:
        url = f"sqlite:///{tmp_path}/dedup.db" if mode == "sqlite" else require_server(mode)
        child_table = table
        effects_db = child_effects = tmp_path / "effects.db"
        effects = Effects(str(effects_db))
        child_args = ["--reconcile", "--lease", "2"]
        opts = {"prefix": table + ":"} if mode == "redis" else {"table": table}

        def count() -> dict[str, int]:
            return effect_counts(effects_db)

        def progress() -> int:
            if not effects_db.exists():
                return 0
            with sqlite3.connect(effects_db, timeout=30) as conn:
                try:
                    return conn.execute("SELECT COUNT(DISTINCT key) FROM effects").fetchone()[0]
                except sqlite3.OperationalError:  # the child has not created the table yet
                    return 0

        def by_pid(pid: int) -> int:
            with sqlite3.connect(effects_db) as conn:
                return conn.execute("SELECT COUNT(*) FROM effects WHERE pid = ?",
                                    (pid,)).fetchone()[0]

        def make_listener():
            def handle(msgs, ctx):
                for i, m in enumerate(msgs):
                    if injected_failure(m):  # the effects before it are done: say so
                        failures["n"] += 1
                        ctx.ack_index = i - 1
                        return ConsumeStatus.RECONSUME_LATER if i == 0 else None
                    effects.apply(m.unique_key)
                return None
            store = open_store(url, **opts)
            closers.append(store.close)
            lst = idempotent(handle, store=store, lease_s=2,
                             reconcile=lambda key, m: effects.done(key))
            listeners.append(lst)
            return lst

    def member() -> PushConsumer:
        c = PushConsumer(addr, group, make_listener(), consume_from="FIRST",
                         rebalance_interval_s=1.0, max_reconsume=1000, batch_size=BATCH)
        c.subscribe("T")
        return c

    sent: list[str] = []
    members: list[PushConsumer] = []
    async with running_broker(str(tmp_path / "data"), delay_levels=LEVELS) as broker:
        addr = f"127.0.0.1:{broker.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 4)

        async def produce() -> None:
            async with Producer(addr) as p:
                for i in range(0, N, 100):
                    res = await p.send_batch("T", [f"order {j}".encode()
                                                   for j in range(i, min(i + 100, N))])
                    sent.extend(r.unique_key for r in res)
                    await asyncio.sleep(0.001)  # orders keep arriving while members change

        child = await start_child(addr, group, url, child_table, child_effects,
                                  *child_args, "--rebalance-interval", "1",
                                  "--commit-interval", "1", "--pull-suspend", "2",
                                  "--max-reconsume", "1000", "--batch-size", str(BATCH))
        try:
            members.append(await member().start())  # B
            producer = asyncio.create_task(produce())
            await wait_until(lambda: progress() >= N // 4, 120, "a quarter", 0.2)
            members.append(await member().start())  # C joins
            await wait_until(lambda: progress() >= N // 2, 120, "half", 0.2)
            child.kill()  # A dies without a word
            await child.wait()
            await wait_until(lambda: progress() >= 3 * N // 4, 120, "three quarters", 0.2)
            await members.pop(0).shutdown()  # B leaves
            members.append(await member().start())  # D joins
            await producer
            await wait_until(lambda: progress() >= N, 240, "every order", 0.2)
            # retries still under way settle: a repeated effect would show up meanwhile
            # (nothing marks "no retry left", so a fixed wait)
            await asyncio.sleep(1.0)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
            for m in members:
                await m.shutdown()
            for close in closers:
                await close()
    counts = count()
    by_child = by_pid(child.pid)
    handled_here = sum(lst.stats["handled"] for lst in listeners)
    if mode == "tx_postgresql":
        db.drop()
    else:
        checker = open_store(url, **opts)
        if hasattr(checker, "drop_table"):
            await checker.drop_table()
        else:
            await checker.drop_all()
        await checker.close()
    assert len(sent) == N
    assert sorted(counts) == sorted(sent)
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}
    assert failures["n"] > 0  # failures were injected and retried
    assert 0 < by_child < N and handled_here > 0  # the killed member had done part of it
