"""Orderly consumption throughput next to concurrent consumption, on the same backlog.

A broker in its own process (async flush), a topic of 8 queues, N messages of 100 bytes
produced first (batches of 100, one queue per batch, as keyed messages arrive), then
drained by consumer processes with a trivial handler (it counts) and the default listener
batch of 1 message: orderly with 1 and with 4 processes, concurrent with 4. Throughput is
N / (time from the consumers being ready to the last message handled). Each configuration
runs on a fresh broker, one after the other in this one invocation.

Usage: python benchmarks/orderly.py [--n 50000] [--repeats 1] [--batch 1]
Prints one JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Steps, note  # noqa: E402
from consume import drain_rate, produce_backlog  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "bench-orderly"
QUEUES = 8


async def worker(mode: str, addr: str, out: str, name: str, batch: int) -> None:
    """One consumer process: counts, and writes "<count> <time of the last> <time of the
    first>" every 50 ms."""
    from onceq.client.push import PushConsumer

    count = 0
    last = first = 0.0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def report() -> None:
        while True:
            with open(f"{out}.tmp", "w") as f:
                f.write(f"{count} {last} {first}")
            os.replace(f"{out}.tmp", out)
            await asyncio.sleep(0.05)

    async def listener(msgs, ctx):
        nonlocal count, last, first
        count += len(msgs)
        last = time.time()
        first = first or last

    reporter = asyncio.create_task(report())
    c = PushConsumer(addr, f"bench-{mode}", listener, consume_from="FIRST", client_id=name,
                     orderly=mode == "orderly", batch_size=batch, rebalance_interval_s=5.0)
    c.subscribe(TOPIC)
    await c.start()
    print("ready", flush=True)
    await stop.wait()
    await c.shutdown()
    reporter.cancel()


def run_once(mode: str, consumers: int, n: int, batch: int) -> float:
    with tempfile.TemporaryDirectory(prefix="onceq-orderly-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        procs = []
        try:
            note(f"  producing {n} messages")
            produce_backlog(addr, n, TOPIC, QUEUES, spread=True)
            outs = [os.path.join(d, f"w{i}.txt") for i in range(consumers)]
            for i, out in enumerate(outs):
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", mode, addr, out, f"w{i}",
                     str(batch)], stdout=subprocess.PIPE, text=True))
            for p in procs:
                p.stdout.readline()
            rate = drain_rate(outs, n, f"{mode} x{consumers}", 600)
            note(f"  {mode} x{consumers}: {rate:.0f} msg/s")
            return rate
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
            broker.terminate()
            broker.wait(60)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, addr, out, name, batch = sys.argv[2:7]
        asyncio.run(worker(mode, addr, out, name, int(batch)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="messages per listener call")
    a = ap.parse_args()
    res = {}
    runs = (("orderly", 1), ("orderly", 4), ("concurrent", 4))
    steps = Steps(len(runs) * a.repeats)
    for mode, k in runs:
        rates = []
        for r in range(a.repeats):
            steps.next(f"{mode}, {k} consumer(s), listener batch {a.batch}, n={a.n}, "
                       f"run {r + 1}/{a.repeats}")
            rates.append(run_once(mode, k, a.n, a.batch))
        res[f"{mode}_x{k}"] = round(statistics.median(rates))
    ratio = res["orderly_x4"] / res["concurrent_x4"]
    print(json.dumps({
        "workload": {"n": a.n, "queues": QUEUES, "body_bytes": 100, "listener_batch": a.batch,
                     "pull_batch": 32, "repeats": a.repeats, "handler": "counts only"},
        "msg_per_s": res,
        "orderly_x4_vs_concurrent_x4": round(ratio, 3),
        "goal": "orderly with 4 consumers >= 0.5x concurrent with 4",
        "goal_met": ratio >= 0.5,
    }, indent=2))


if __name__ == "__main__":
    main()
