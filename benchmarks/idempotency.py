"""What consumer idempotency costs: push-consumer throughput with a trivial handler, without
dedup and with each dedup store, listener batches of 1 and 32.

A broker in its own process (async flush), a topic of 8 queues and N messages of 100 bytes
produced first; then, in this process, one push consumer drains them (pull batch 32) with
the no-op handler bare or wrapped by ``idempotent(..., store=URL)``. Throughput is N / (time
from start to the last message handled); the CPU time of this process over the same span,
per message, is reported too. Each configuration runs on a fresh topic and a
fresh dedup table (or key prefix). ``--runs R`` repeats every configuration R times, in
rounds; rates are medians, and ratios the median of each round's ratio to that round's
"none" (on a shared machine the rates move between rounds; compare within a round).

``--handler-us U`` gives the handler U microseconds of CPU work per message (a busy loop),
to see what the layer costs next to a handler that does something.

Usage: python benchmarks/idempotency.py [--n 20000] [--runs 1] [--stores none,sqlite,...]
       [--handler-us 0] [--batches 1,32]
(stores: none, sqlite, sqlite_normal (synchronous=NORMAL), redis, mysql, postgresql,
tx_sqlite, tx_postgresql: the transactional mode with a handler that writes nothing)
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402
from throughput import start_broker  # noqa: E402

from onceq import Admin, Producer  # noqa: E402
from onceq.client.push import PushConsumer  # noqa: E402
from onceq.idempotency import idempotent, open_store, transactional  # noqa: E402

QUEUES = 8
URLS = {
    "sqlite": "sqlite:///{dir}/dedup.db",
    "sqlite_normal": "sqlite:///{dir}/dedup_normal.db?synchronous=NORMAL",
    "redis": "redis://127.0.0.1:6379/0",
    "mysql": "mysql://root@127.0.0.1:3306/test",
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
}
TX = {"tx_sqlite": "sqlite:///{dir}/shop.db", "tx_postgresql": URLS["postgresql"]}


def work(seconds: float) -> None:
    """The handler's CPU work: a busy loop (it holds the GIL, as Python code does)."""
    if seconds > 0:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


async def run_once(addr: str, store_kind: str, batch: int, n: int, tmp: str,
                   handler_s: float = 0.0) -> tuple[float, float]:
    topic = f"bench_{store_kind}_{batch}_{uuid.uuid4().hex[:6]}"
    async with Admin(addr) as admin:
        await admin.create_topic(topic, QUEUES)
    note(f"  producing {n} messages")
    async with Producer(addr) as p:
        for i in range(0, n, 100):
            await p.send_batch(topic, [b"x" * 100] * min(100, n - i))
    done = asyncio.Event()
    count = 0

    async def handle(msgs, ctx):
        nonlocal count
        work(handler_s * len(msgs))
        count += len(msgs)
        if count >= n:
            done.set()

    store = None
    listener = handle
    if store_kind in TX:
        def handle_tx(m, conn):  # a worker thread; the watcher below ends the run
            nonlocal count
            work(handler_s)
            count += 1

        store = transactional(handle_tx, db=TX[store_kind].format(dir=tmp),
                              table=f"onceq_bench_{uuid.uuid4().hex[:8]}")
        listener = store

        async def watch() -> None:
            while count < n:
                await asyncio.sleep(0.005)
            done.set()

        asyncio.get_running_loop().create_task(watch())
    elif store_kind != "none":
        name = f"onceq_bench_{uuid.uuid4().hex[:8]}"
        opts = {"prefix": name + ":"} if store_kind == "redis" else {"table": name}
        # (sqlite_normal passes synchronous=NORMAL in its URL)
        store = open_store(URLS[store_kind].format(dir=tmp), **opts)
        listener = idempotent(handle, store=store)
    consumer = PushConsumer(addr, f"g_{topic}", listener, consume_from="FIRST",
                            batch_size=batch)
    consumer.subscribe(topic)
    progress = Count("consumed", n)

    async def report() -> None:  # reads the count: nothing added to the handler
        while True:
            await asyncio.sleep(1.0)
            progress.add(count - progress.n)

    reporter = asyncio.get_running_loop().create_task(report())
    t0 = time.perf_counter()
    c0 = time.process_time()
    await consumer.start()
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0  # this process: the consumer and the layer's threads
    reporter.cancel()
    progress.add(count - progress.n)
    progress.done()
    await consumer.shutdown()
    if os.environ.get("ONCEQ_BENCH_DEBUG"):
        print(store_kind, batch, dict(getattr(listener, "stats", {})), dict(consumer.stats),
              file=sys.stderr)
    if store is not None:
        if hasattr(store, "drop_table"):
            await store.drop_table()
        elif hasattr(store, "drop_all"):
            await store.drop_all()
        await store.close()
    return n / elapsed, cpu / n * 1e6


async def main_async(a: argparse.Namespace) -> dict:
    stores = a.stores.split(",")
    runs: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="onceq-idem-bench-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        try:
            steps = Steps(a.runs * len(a.batches) * len(stores))
            for r in range(a.runs):  # rounds: every configuration once per round
                for batch in a.batches:
                    for kind in stores:
                        n = a.n if batch == 32 else max(1000, a.n // 4)
                        steps.next(f"store {kind}, listener batch {batch}, n={n}, "
                                   f"round {r + 1}/{a.runs}")
                        rate, us = await run_once(addr, kind, batch, n, d, a.handler_us / 1e6)
                        runs.setdefault(f"batch_{batch}", {}).setdefault(kind, []).append(rate)
                        cpu.setdefault(f"batch_{batch}", {}).setdefault(kind, []).append(us)
        finally:
            broker.terminate()
            broker.wait(60)
    res = {b: {k: round(statistics.median(v)) for k, v in r.items()} for b, r in runs.items()}
    # each round's rate against the same round's "none" (run minutes apart at most), median
    ratios = {b: {k: round(statistics.median(x / y for x, y in zip(v, r["none"], strict=True)),
                           3)
                  for k, v in r.items() if k != "none"}
              for b, r in runs.items() if "none" in r}
    out = {
        "workload": {"n_batch_32": a.n, "n_batch_1": max(1000, a.n // 4), "queues": QUEUES,
                     "body_bytes": 100, "pull_batch": 32, "runs": a.runs,
                     "handler": f"{a.handler_us} us of CPU work per message"
                     if a.handler_us else "no-op"},
        "msg_per_s": res,
        "vs_no_dedup": ratios,
        # CPU time of the consuming process per message (a database server's own time is
        # not in it): steadier than the rates on a shared machine
        "consumer_cpu_us_per_msg": {b: {k: round(statistics.median(v), 1)
                                        for k, v in r.items()} for b, r in cpu.items()},
        "goal": "batch 32: SQLite and Redis dedup cost <= 15% (ratio >= 0.85), "
                "transactional SQLite <= 30% (ratio >= 0.7)",
    }
    if a.runs > 1:
        out["msg_per_s_runs"] = {b: {k: [round(x) for x in v] for k, v in r.items()}
                                 for b, r in runs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=1,
                    help="rounds of every configuration; medians are reported")
    ap.add_argument("--handler-us", type=float, default=0.0,
                    help="CPU work of the handler per message, in microseconds")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 32], help="listener batch sizes (default 1,32)")
    ap.add_argument("--stores", default="none,sqlite,sqlite_normal,redis,mysql,postgresql,"
                                        "tx_sqlite,tx_postgresql")
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=2))


if __name__ == "__main__":
    main()
