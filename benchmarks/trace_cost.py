"""Cost of the delivery trace on the pull path: a group's pulls with tracing off and on.

One broker in its own process (async flush), a topic of 4 queues, N messages of 100 bytes.
Two groups drain the same backlog with raw pulls (batch 32, one request in flight per
queue, group and client ids as a push consumer sends them): ``plain`` (tracing off) and
``traced`` (tracing on: the broker stores one trace message per pull that found messages).
The two alternate ``--rounds`` times, each from offset 0 (raw pulls commit nothing), so
both see the same machine load; figures are the medians.

Usage: python benchmarks/trace_cost.py [--n 50000] [--rounds 3]
Prints one JSON document (progress on stderr).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "trace-cost"
QUEUES = 4


async def _drain(addr: str, group: str, n: int) -> tuple[float, int]:
    """(messages per second, pulls that found messages)"""
    from onceq.client.connection import BrokerConnection, call
    from onceq.protocol.codes import PullStatus
    from onceq.protocol.requests import Pull

    conns = [await BrokerConnection.open(addr) for _ in range(QUEUES)]

    pulls = 0

    async def one(q: int) -> int:
        nonlocal pulls
        got, offset = 0, 0
        while True:
            r = await call(conns[q], Pull(TOPIC, q, offset, 32, group=group,
                                          client=f"{group}-c{q}"))
            if r.status != PullStatus.FOUND:
                return got
            got += r.count
            pulls += 1
            offset = r.next

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(q) for q in range(QUEUES))))
    took = time.perf_counter() - t0
    for c in conns:
        c.close()
    assert total == n, (total, n)
    return n / took, pulls


async def run(n: int, rounds: int) -> dict:
    from onceq import Admin, Producer

    with tempfile.TemporaryDirectory(prefix="onceq-trace-cost-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        try:
            async with Admin(addr) as admin:
                await admin.create_topic(TOPIC, QUEUES)
                await admin.group_trace("traced", True)
                note(f"producing {n} messages")
                async with Producer(addr) as p:
                    for i in range(0, n, 500):
                        await p.send_batch(TOPIC, [b"x" * 100] * min(500, n - i),
                                           queue=(i // 500) % QUEUES)
                rates: dict[str, list[float]] = {"plain": [], "traced": []}
                traced_pulls = 0
                for r in range(rounds):
                    for group in ("plain", "traced"):
                        rate, pulls = await _drain(addr, group, n)
                        rates[group].append(rate)
                        traced_pulls += pulls if group == "traced" else 0
                        note(f"round {r + 1}/{rounds} {group}: {rates[group][-1]:.0f} msg/s")
                traced = sum(hi - lo for lo, hi in await admin.topic_offsets("%TRACE%"))
        finally:
            broker.terminate()
            broker.wait(60)
    plain_med, traced_med = (statistics.median(rates[g]) for g in ("plain", "traced"))
    return {"n": n, "rounds": rounds, "pull_msg_s_tracing_off": round(plain_med),
            "pull_msg_s_tracing_on": round(traced_med),
            "ratio_on_off": round(traced_med / plain_med, 3),
            "trace_messages_stored": traced, "traced_pulls": traced_pulls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a.n, a.rounds)), indent=2))


if __name__ == "__main__":
    main()
