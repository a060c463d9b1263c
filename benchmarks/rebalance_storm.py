"""Rebalance storm: duplicate deliveries caused by rebalances, access lock off vs on.

A topic of 16 queues; a producer at a steady rate; handlers taking a few milliseconds;
consumer processes joining and leaving on a fixed schedule (scale 1 -> 4 -> 2 -> 5 -> 1,
each leave a graceful shutdown) and one consumer SIGKILLed once. Every delivery is logged
per consumer; afterwards deliveries are counted per unique key:

* lost: produced keys never delivered;
* duplicates: deliveries beyond the first, split into those caused by the SIGKILL (the
  earlier delivery was by the killed consumer: its unacknowledged messages must be
  redelivered) and those caused by rebalances (all others);
* throughput: deliveries per second over the run, and the time to drain the backlog after
  the producer stops.

Both configurations run in the same invocation, each on a fresh broker.
Usage: python benchmarks/rebalance_storm.py [--phase-s 6] [--rate 1000] [--handler-ms 2]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from throughput import start_broker  # noqa: E402

TOPIC = "storm"
GROUP = "storm-group"
SCHEDULE = [1, 4, 2, 5, 1]


async def _produce(addr: str, rate: int, seconds: float, keys_out: list[str]) -> None:
    from onceq import Producer

    async with Producer(addr) as p:
        batch = max(rate // 100, 1)  # 100 sends a second
        t0 = time.monotonic()
        sent = 0
        while time.monotonic() - t0 < seconds:
            results = await p.send_batch(TOPIC, [b"x" * 100] * batch)
            keys_out.extend(r.unique_key for r in results)
            sent += batch
            ahead = sent / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)


def _spawn(addr: str, name: str, out: str, lock: bool, handler_ms: float
           ) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "storm_consumer.py"), addr, GROUP, TOPIC, name,
         out, "1" if lock else "0", str(handler_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # "ready"
    return proc


async def run_config(lock: bool, phase_s: float, rate: int, handler_ms: float,
                     drain_timeout: float) -> dict:
    from onceq import Admin

    with tempfile.TemporaryDirectory(prefix="onceq-storm-") as d:
        broker, addr = start_broker(os.path.join(d, "data"), "async")
        procs: dict[str, subprocess.Popen] = {}
        files: dict[str, str] = {}
        try:
            async with Admin(addr) as admin:
                await admin.create_topic(TOPIC, 16)
            keys: list[str] = []
            t0 = time.monotonic()
            t0_wall = time.time()
            prod = asyncio.create_task(_produce(addr, rate, phase_s * len(SCHEDULE), keys))
            serial = 0
            killed = None
            for i, target in enumerate(SCHEDULE):
                while len(procs) < target:
                    serial += 1
                    name = f"c{serial}"
                    files[name] = os.path.join(d, f"{name}.log")
                    procs[name] = await asyncio.to_thread(_spawn, addr, name, files[name], lock,
                                                          handler_ms)
                while len(procs) > target:
                    name = next(iter(procs))
                    p = procs.pop(name)
                    p.terminate()
                    await asyncio.to_thread(p.wait, 60)
                if i == 3:  # at scale 5, SIGKILL one member mid-phase
                    await asyncio.sleep(phase_s / 2)
                    killed = list(procs)[-1]
                    procs.pop(killed).send_signal(signal.SIGKILL)
                    serial += 1
                    name = f"c{serial}"
                    files[name] = os.path.join(d, f"{name}.log")
                    procs[name] = await asyncio.to_thread(_spawn, addr, name, files[name], lock,
                                                          handler_ms)
                    await asyncio.sleep(phase_s / 2)
                else:
                    await asyncio.sleep(phase_s)
            await prod
            t_prod = time.monotonic()
            produced = set(keys)
            deadline = time.monotonic() + drain_timeout
            while time.monotonic() < deadline:
                seen = set()
                for f in files.values():
                    with open(f) as fh:
                        seen.update(line.split(" ", 1)[0] for line in fh)
                if produced <= seen:
                    break
                await asyncio.sleep(0.2)
            t_drained = time.monotonic()
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(60)
            broker.terminate()
            broker.wait(60)
        deliveries: dict[str, list[tuple[float, str, str]]] = collections.defaultdict(list)
        total = 0
        for name, f in files.items():
            with open(f) as fh:
                for line in fh:
                    key, ts, where = line.split()
                    deliveries[key].append((float(ts), name, where))
                    total += 1
    dup_crash = dup_rebalance = 0
    examples = []
    for who in deliveries.values():
        who.sort()
        for i in range(1, len(who)):
            if any(w[1] == killed for w in who[:i]):
                dup_crash += 1
            else:
                dup_rebalance += 1
                if len(examples) < 5:
                    examples.append([f"{n}@{ts - t0_wall:.2f}s {w}" for ts, n, w in who])
    lost = len(produced - set(deliveries))
    return {
        "access_lock": lock,
        "produced": len(produced),
        "deliveries": total,
        "lost": lost,
        "duplicates_rebalance": dup_rebalance,
        "duplicates_crash": dup_crash,
        "throughput_msg_s": round(total / max(t_drained - t0, 1e-9)),
        "drain_after_producer_s": round(t_drained - t_prod, 2),
        "consumers_started": serial,
        "killed": killed,
        "duplicate_examples": examples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--handler-ms", type=float, default=2.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    a = ap.parse_args()
    runs = {}
    for lock in (False, True):
        runs["lock_on" if lock else "lock_off"] = asyncio.run(
            run_config(lock, a.phase_s, a.rate, a.handler_ms, a.drain_timeout))
    off, on = runs["lock_off"], runs["lock_on"]
    report = {
        "workload": {"queues": 16, "schedule": SCHEDULE, "phase_s": a.phase_s,
                     "rate_msg_s": a.rate, "handler_ms": a.handler_ms, "sigkill": 1},
        **runs,
        "goals": {
            "lost == 0 (both)": off["lost"] == 0 and on["lost"] == 0,
            "rebalance duplicates on <= 1% of off": (
                on["duplicates_rebalance"] <= 0.01 * off["duplicates_rebalance"]
                if off["duplicates_rebalance"] else on["duplicates_rebalance"] == 0),
            "throughput cost of the lock (1 - on/off)": round(
                1 - on["throughput_msg_s"] / off["throughput_msg_s"], 3),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
