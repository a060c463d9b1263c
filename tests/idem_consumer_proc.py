"""An idempotent push consumer in its own process, for tests that SIGKILL it mid-way.

The business effect of a message is a row ``(key, pid)`` inserted into the table
``effects`` of the SQLite file ``--effects`` (committed per message), so the parent counts
effects after a kill. Offsets are committed only on shutdown or after long intervals
(``--commit-interval``, long polling of ``--pull-suspend``): a SIGKILL lands after the
effects and their ``CONSUMED`` records but before the offset commit. With
``--hang-after-effect`` the handler never returns after its effect (a crash between the
effect and ``CONSUMED``). With ``--transactional TABLE`` the effects are rows of TABLE in
the ``--store`` database, written in the dedup rows' transaction (``--hang-after-effect``
then hangs before the commit, after printing ``HANGING``). With ``--crash-in-completion``
the process dies in the first store call that carries a batch's completion with other
batches' claims, before that call commits. Prints ``READY <client id>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

from onceq.client.push import PushConsumer
from onceq.idempotency import idempotent


class Effects:
    """The business side: one row per effect, in a SQLite file shared with the test."""

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                     timeout=30)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # survives a SIGKILL, not a power cut
        self._conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, "
                           "pid INTEGER NOT NULL)")
        self._lock = threading.Lock()

    def apply(self, key: str) -> None:
        with self._lock:
            self._conn.execute("INSERT INTO effects VALUES (?, ?)", (key, os.getpid()))

    def done(self, key: str) -> bool:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM effects WHERE key = ?",
                                      (key,)).fetchone()[0] > 0


def crash_in_completion() -> None:
    """The process dies (``os._exit``: no cleanup, no commit) in the first store call
    that carries completions together with claims: in the SQL stores' transaction after
    its statements and before its commit, or before the one-trip statement or the Redis
    script is sent. The handler's effects of those messages happened; their ``CONSUMED``
    records never reach the store."""
    from onceq.idempotency import redis_store, sql

    def crash(completed: list[Any]) -> None:
        keys = [k for items in completed for _, k, _, _ in items]
        print("CRASH " + " ".join(keys), flush=True)
        os._exit(137)

    def split(store: Any, ops: list[Any]) -> tuple[list[Any], bool]:
        completed = [args[1] for fn, args in ops if fn == store._complete_keys_op]
        return completed, any(fn == store._claim_keys_op for fn, _ in ops)

    apply_group, one_trip = sql.SqlStore._apply_group, sql.SqlStore._one_trip
    ops_group = redis_store.RedisStore._ops_group

    def crashing_apply(self: Any, cur: Any, now: float, ops: list[Any]) -> Any:
        out = apply_group(self, cur, now, ops)  # the statements ran; no commit follows
        completed, claims = split(self, ops)
        if completed and claims:
            crash(completed)
        return out

    def crashing_trip(self: Any, ops: list[Any]) -> Any:
        completed, claims = split(self, ops)
        if completed and claims:
            crash(completed)
        return one_trip(self, ops)

    async def crashing_ops(self: Any, ops: list[Any]) -> Any:
        completed = [op[2] for op in ops if op[0] == "complete"]
        if completed and any(op[0] == "claim" for op in ops):
            crash(completed)
        return await ops_group(self, ops)

    sql.SqlStore._apply_group = crashing_apply  # type: ignore[method-assign]
    sql.SqlStore._one_trip = crashing_trip  # type: ignore[method-assign]
    redis_store.RedisStore._ops_group = crashing_ops  # type: ignore[method-assign]


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--table", default="onceq_dedup")
    ap.add_argument("--effects", default=None)
    ap.add_argument("--transactional", default=None, metavar="EFFECTS_TABLE",
                    help="transactional mode: effects are rows of this table in the --store "
                         "database, written in the dedup row's transaction")
    ap.add_argument("--lease", type=float, default=60.0)
    ap.add_argument("--commit-interval", type=float, default=3600.0)
    ap.add_argument("--pull-suspend", type=float, default=60.0)
    ap.add_argument("--rebalance-interval", type=float, default=20.0)
    ap.add_argument("--max-reconsume", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--hang-after-effect", action="store_true")
    ap.add_argument("--reconcile", action="store_true",
                    help="ambiguous outcomes: ask the effects table whether it was done")
    ap.add_argument("--crash-in-completion", action="store_true",
                    help="die in the first store call that carries a batch's completion "
                         "together with claims, before it commits (prints CRASH and the "
                         "keys of the completions lost)")
    args = ap.parse_args(argv)
    if args.crash_in_completion:
        crash_in_completion()
    from onceq.idempotency import open_store, transactional

    store: Any = None
    if args.transactional:
        mark = "?" if args.store.startswith("sqlite") else "%s"

        def handle_tx(m, conn):  # inside the transaction of the dedup rows
            conn.cursor().execute(f"INSERT INTO {args.transactional} (k, pid) VALUES "
                                  f"({mark}, {mark})", (m.unique_key, os.getpid()))
            if args.hang_after_effect:  # killed before the commit
                print("HANGING", flush=True)
                time.sleep(3600)

        listener: Any = transactional(handle_tx, db=args.store, table=args.table)
    else:
        effects = Effects(args.effects)

        def handle(msgs, ctx):  # a plain function: runs in a worker thread
            for m in msgs:
                effects.apply(m.unique_key)
            if args.hang_after_effect:
                time.sleep(3600)
            if args.crash_in_completion:  # handlers end at different times, while other
                time.sleep(0.003 * (msgs[0].queue_offset % 7))  # batches are claimed

        opt = {"prefix": args.table + ":"} if args.store.startswith("redis") else {
            "table": args.table}
        store = open_store(args.store, **opt)
        opts: dict[str, Any] = {}
        if args.reconcile:
            opts["reconcile"] = lambda key, m: effects.done(key)
        listener = idempotent(handle, store=store, lease_s=args.lease, **opts)
    consumer = PushConsumer(args.addr, args.group, listener, consume_from="FIRST",
                            commit_interval_s=args.commit_interval,
                            pull_suspend_s=args.pull_suspend, consume_timeout_s=7200,
                            rebalance_interval_s=args.rebalance_interval,
                            max_reconsume=args.max_reconsume, batch_size=args.batch_size)
    consumer.subscribe(args.topic, "*")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await consumer.start()
    print(f"READY {consumer.client_id}", flush=True)
    await stop.wait()
    await consumer.shutdown()
    await (store or listener).close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
