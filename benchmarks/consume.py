"""Push-consumer throughput next to raw pulls, on the same backlog.

A broker in its own process (async flush), a topic of 8 queues, N messages of 100 bytes
produced first by one producer process, then drained by: the raw pull consumer (one
process, a prefetching stream per queue, pull batch 32), the push consumer with 1 process,
and with 3 processes (listener batch 32, pull batch 32, a no-op listener). Throughput is
N / (time from the consumers being ready to the last message handled). Each configuration
runs on a fresh broker; figures are medians of --repeats runs.

Usage: python benchmarks/consume.py [--n 200000] [--repeats 3]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from throughput import start_broker  # noqa: E402

TOPIC = "bench"
QUEUES = 8


def _produce(addr: str, n: int) -> None:
    code = (
        "import asyncio\n"
        "from onceq import Admin, Producer\n"
        "async def main():\n"
        f"    async with Admin({addr!r}) as a:\n"
        f"        await a.create_topic({TOPIC!r}, {QUEUES})\n"
        f"    async with Producer({addr!r}) as p:\n"
        f"        for i in range(0, {n}, 100):\n"
        f"            await p.send_batch({TOPIC!r}, [b'x' * 100] * min(100, {n} - i))\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def _read(path: str) -> tuple[int, float]:
    try:
        with open(path) as f:
            c, t = f.read().split()
        return int(c), float(t)
    except (FileNotFoundError, ValueError):
        return 0, 0.0


def run_once(mode: str, consumers: int, n: int) -> float:
    with tempfile.TemporaryDirectory(prefix="onceq-consume-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        procs = []
        try:
            _produce(addr, n)
            outs = [os.path.join(d, f"w{i}.txt") for i in range(consumers)]
            for i, out in enumerate(outs):
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "consume_worker.py"), mode, addr,
                     TOPIC, str(QUEUES), out, f"w{i}"],
                    stdout=subprocess.PIPE, text=True))
            for p in procs:
                p.stdout.readline()
            t0 = time.time()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                got = [_read(o) for o in outs]
                if sum(c for c, _ in got) >= n:
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError(f"{mode} x{consumers}: only {sum(c for c, _ in got)} of {n}")
            last = max(t for _, t in got)
            return n / (last - t0)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
            broker.terminate()
            broker.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res = {}
    for mode, k in (("pull", 1), ("push", 1), ("push", 3)):
        rates = [run_once(mode, k, a.n) for _ in range(a.repeats)]
        res[f"{mode}_x{k}"] = round(statistics.median(rates))
    report = {
        "workload": {"n": a.n, "queues": QUEUES, "body_bytes": 100, "pull_batch": 32,
                     "listener_batch": 32, "repeats": a.repeats},
        "msg_per_s": res,
        "push_vs_raw_pull": {k: round(v / res["pull_x1"], 3) for k, v in res.items()
                             if k.startswith("push")},
        "goal": "push consumer loses no more than 20% against raw pulls (ratio >= 0.8)",
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
