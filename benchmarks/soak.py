"""Soak: a broker under steady load for N minutes; its RSS and open fds must stay flat.

First the producer's maximum rate is measured for a few seconds (batches of ``--batch``),
then a producer sends at ``--load`` (default half) of it to a topic of ``--queues`` queues
while a consumer group of ``--consumers`` push-consumer processes drains it. Segments are
small and retention by size is on, so segment files are created and deleted throughout.
Every ``--sample-s`` seconds the broker's RSS and open file descriptors are sampled from
/proc. After ``--warmup-s`` (long enough for the dedup window to fill to its cap) the
samples must stay flat: the JSON reports the growth of RSS and fds after warm-up.

Usage: python benchmarks/soak.py [--minutes 10] [--load 0.5] [--queues 8] [--consumers 2]
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import note  # noqa: E402
from throughput import start_broker  # noqa: E402

TOPIC = "soak"
BODY = b"x" * 100


def proc_sample(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process, read from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def measure_max_rate(addr: str, batch: int, seconds: float) -> tuple[float, int]:
    """(messages per second, messages sent) of one producer sending as fast as it can."""
    from onceq import Producer

    async with Producer(addr) as p:
        msgs = [BODY] * batch
        await p.send_batch(TOPIC, msgs)
        sent = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await p.send_batch(TOPIC, msgs)
            sent += batch
        return sent / (time.perf_counter() - t0), sent + batch


async def produce(addr: str, rate: float, batch: int, seconds: float, counts: dict) -> None:
    from onceq import OnceqError, Producer

    async with Producer(addr) as p:
        msgs = [BODY] * batch
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < seconds:
            try:
                await p.send_batch(TOPIC, msgs)
                counts["sent"] += batch
            except OnceqError as exc:
                counts["errors"] += 1
                counts["last_error"] = str(exc)
            ahead = counts["sent"] / rate - elapsed
            if ahead > 0:
                await asyncio.sleep(ahead)


def _consumed(files: list[str]) -> int:
    total = 0
    for f in files:
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


async def run(args: argparse.Namespace) -> dict:
    from onceq import Admin

    with tempfile.TemporaryDirectory(prefix="onceq-soak-") as d:
        data_dir = os.path.join(d, "data")
        broker, addr = start_broker(data_dir, args.flush, [
            "--segment-size", str(args.segment_mib * 1024 * 1024),
            "--retention-bytes", str(args.retention_mib * 1024 * 1024)])
        consumers: list[subprocess.Popen] = []
        try:
            async with Admin(addr) as admin:
                await admin.create_topic(TOPIC, args.queues)
            note(f"measuring the maximum produce rate for {args.probe_s:.0f} s")
            max_rate, probe_sent = await measure_max_rate(addr, args.batch, args.probe_s)
            rate = max_rate * args.load
            note(f"max {max_rate:,.0f} msg/s; soaking at {rate:,.0f} msg/s for "
                      f"{args.minutes:g} min with {args.consumers} consumers")
            files = [os.path.join(d, f"c{i}.count") for i in range(args.consumers)]
            for i, out in enumerate(files):
                p = subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "consume_worker.py"), "push", addr,
                     TOPIC, str(args.queues), out, f"soak{i}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                p.stdout.readline()  # "ready"
                consumers.append(p)
            counts: dict = {"sent": 0, "errors": 0, "last_error": None}
            seconds = args.minutes * 60
            prod = asyncio.create_task(produce(addr, rate, args.batch, seconds, counts))
            samples = []
            t0 = time.monotonic()
            while not prod.done():
                rss, fds = proc_sample(broker.pid)
                t = time.monotonic() - t0
                consumed = _consumed(files)
                samples.append({"t_s": round(t, 1), "rss_mib": round(rss, 1), "fds": fds,
                                "sent": counts["sent"] + probe_sent, "consumed": consumed})
                note(f"{t:6.0f}/{seconds:.0f} s  rss {rss:7.1f} MiB  fds {fds:4d}  "
                          f"sent {counts['sent']:,}  consumed {consumed:,}")
                await asyncio.wait({prod}, timeout=args.sample_s)
            await prod
            deadline = time.monotonic() + 60
            while _consumed(files) < counts["sent"] + probe_sent and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            consumed = _consumed(files)
            rss, fds = proc_sample(broker.pid)
            samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss, 1),
                            "fds": fds, "sent": counts["sent"] + probe_sent, "consumed": consumed})
        finally:
            for p in consumers:
                p.terminate()
            for p in consumers:
                p.wait(60)
            broker.terminate()
            broker.wait(60)
    after = [s for s in samples if s["t_s"] >= args.warmup_s] or samples[-1:]
    base = after[0]
    return {
        "minutes": args.minutes, "queues": args.queues, "consumers": args.consumers,
        "flush": args.flush, "max_rate": round(max_rate), "rate": round(rate),
        "sent": counts["sent"] + probe_sent, "consumed": consumed,
        "send_errors": counts["errors"],
        "last_send_error": counts["last_error"],
        "warmup_s": args.warmup_s,
        "rss_mib_at_warmup": base["rss_mib"],
        "rss_mib_max_after_warmup": max(s["rss_mib"] for s in after),
        "rss_growth_mib_after_warmup": round(after[-1]["rss_mib"] - base["rss_mib"], 1),
        "fds_at_warmup": base["fds"],
        "fds_max_after_warmup": max(s["fds"] for s in after),
        "fds_growth_after_warmup": after[-1]["fds"] - base["fds"],
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--load", type=float, default=0.5, help="fraction of the measured max")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--flush", choices=["async", "sync"], default="async")
    ap.add_argument("--probe-s", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--retention-mib", type=int, default=512)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
