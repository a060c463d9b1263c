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

from _progress import Count, Steps, note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "bench"
QUEUES = 8


def produce_backlog(addr: str, n: int, topic: str = TOPIC, queues: int = QUEUES,
                    spread: bool = False) -> None:
    """Create ``topic`` and store ``n`` messages of 100 bytes in batches of 100, in a child
    process (``spread``: batch i to queue i % queues, else the producer's choice)."""
    queue = f", queue=(i // 100) % {queues}" if spread else ""
    code = (
        "import asyncio\n"
        "from onceq import Admin, Producer\n"
        "async def main():\n"
        f"    async with Admin({addr!r}) as a:\n"
        f"        await a.create_topic({topic!r}, {queues})\n"
        f"    async with Producer({addr!r}) as p:\n"
        f"        for i in range(0, {n}, 100):\n"
        f"            await p.send_batch({topic!r}, [b'x' * 100] * min(100, {n} - i){queue})\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def read_progress(path: str) -> tuple[int, float, float]:
    """What a worker wrote: messages counted, the time of the last one and of the first."""
    try:
        with open(path) as f:
            c, last, first = f.read().split()
        return int(c), float(last), float(first)
    except (FileNotFoundError, ValueError):
        return 0, 0.0, 0.0


def drain_rate(outs: list[str], n: int, label: str, timeout: float) -> float:
    """Wait (bounded) until the workers writing ``outs`` counted ``n`` messages in all,
    showing progress; their messages per second."""
    t0 = time.time()
    deadline = time.monotonic() + timeout
    count = Count(f"{label} consumed", n)
    while time.monotonic() < deadline:
        got = [read_progress(o) for o in outs]
        total = sum(c for c, _l, _f in got)
        count.add(total - count.n)
        if total >= n:
            count.done()
            return rate_of(n, got, t0)
        time.sleep(0.05)
    raise RuntimeError(f"{label}: only {total} of {n}")


def rate_of(n: int, got: list[tuple[int, float, float]], t0: float) -> float:
    """Messages per second from the first message (or ``t0``, the workers all ready, if
    earlier: a small backlog may be drained before the last worker is ready) to the last."""
    start = min([t0] + [f for c, _l, f in got if c])
    return n / max(max(t for _, t, _f in got) - start, 1e-9)


def run_once(mode: str, consumers: int, n: int) -> float:
    with tempfile.TemporaryDirectory(prefix="onceq-consume-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        procs = []
        try:
            note(f"  producing {n} messages")
            produce_backlog(addr, n)
            outs = [os.path.join(d, f"w{i}.txt") for i in range(consumers)]
            for i, out in enumerate(outs):
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "consume_worker.py"), mode, addr,
                     TOPIC, str(QUEUES), out, f"w{i}"],
                    stdout=subprocess.PIPE, text=True))
            for p in procs:
                p.stdout.readline()
            return drain_rate(outs, n, f"{mode} x{consumers}", 300)
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
    configs = (("pull", 1), ("push", 1), ("push", 3))
    steps = Steps(len(configs) * a.repeats)
    for mode, k in configs:
        rates = []
        for r in range(a.repeats):
            steps.next(f"{mode} consumer x{k}: n={a.n}, run {r + 1}/{a.repeats}")
            rates.append(run_once(mode, k, a.n))
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
