"""Ping latency while the broker's periodic snapshots run at their worst.

A broker process (async flush) is loaded with one large table, then kept changing it while
one more connection pings every 20 ms for ``--seconds``; the figure is the pings' p50, p99
and max. Scenarios:

* ``writers``: ``--writers`` idempotent-writer sequences (writer ids x queues of one
  topic, one sequenced send each), then sequenced sends go on so that ``writers.json`` is
  written every second;
* ``offsets``: ``--offsets`` committed offsets (groups x queues of one topic), then commits
  go on so that ``offsets.json`` is written every second;
* ``topics``: another connection creates and deletes topics (4 queues each), ``--topics``
  operations pipelined at a time, round after round, while the pings run (each one
  writes the topics table, and a creation fsyncs the commit log).

The requests go over the wire as header maps, so ``--src`` can run source trees of any age
(each tree in turn, per scenario; the goal is a ping p99 under 50 ms).

Usage: python benchmarks/loop_stalls.py [--writers 200000] [--offsets 160000]
       [--topics 2000] [--seconds 10] [--src DIR ...]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402

QUEUES = 1000
TOPIC = "stall"


async def raw(addr: str):
    from onceq.protocol.frame import FrameDecoder

    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    return reader, writer, FrameDecoder()


async def pipelined(addr: str, frames: list[bytes], count: Count) -> None:
    """Send ``frames`` (requests numbered 1..n) in windows; wait for every answer."""
    reader, writer, decoder = await raw(addr)
    try:
        for i in range(0, len(frames), 500):
            window = frames[i:i + 500]
            writer.write(b"".join(window))
            got = 0
            while got < len(window):
                decoder.feed(await reader.read(1 << 16))
                for _v, _k, code, _c, _h, _p in decoder.frames():
                    if code:
                        raise RuntimeError(f"a load request failed with code {code}")
                    got += 1
            count.add(len(window))
    finally:
        writer.close()


def sequenced(writer: str, queue: int, epoch: int) -> bytes:
    from onceq.client.sequenced import encode_sequenced
    from onceq.protocol.codes import RequestCode
    from onceq.protocol.frame import REQUEST, encode_frame

    payload = encode_sequenced(writer, epoch, 0, [(b"x", "", "", "", None)], 1)
    return encode_frame(REQUEST, RequestCode.SEND_SEQUENCED, 1,
                        {"topic": TOPIC, "queue": queue, "writer": writer, "epoch": epoch,
                         "seq": 0}, payload)


def commit(group: str, queue: int, offset: int) -> bytes:
    from onceq.protocol.codes import RequestCode
    from onceq.protocol.frame import REQUEST, encode_frame

    return encode_frame(REQUEST, RequestCode.COMMIT_OFFSET, 1,
                        {"group": group, "topic": TOPIC, "queue": queue, "offset": offset})


async def pings(addr: str, seconds: float) -> list[float]:
    from onceq.protocol.codes import RequestCode
    from onceq.protocol.frame import REQUEST, encode_frame

    reader, writer, decoder = await raw(addr)
    out = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            writer.write(encode_frame(REQUEST, RequestCode.PING, 7))
            got = False
            while not got:
                decoder.feed(await reader.read(1 << 16))
                got = bool(decoder.frames())
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    finally:
        writer.close()
    return out


async def keep_changing(addr: str, scenario: str, stop: asyncio.Event) -> None:
    """One change every 50 ms: the table is dirty at every snapshot."""
    reader, writer, decoder = await raw(addr)
    i = 0
    try:
        while not stop.is_set():
            i += 1
            writer.write(sequenced("live", 0, i) if scenario == "writers"
                         else commit("live", 0, 0))
            got = False
            while not got:
                decoder.feed(await reader.read(1 << 16))
                got = bool(decoder.frames())
            await asyncio.sleep(0.05)
    finally:
        writer.close()


def topic_change(i: int) -> bytes:
    """Operation ``i``: create topic ``t<i // 2>`` (even), delete it (odd)."""
    from onceq.protocol.codes import RequestCode
    from onceq.protocol.frame import REQUEST, encode_frame

    name = f"churn{i // 2}"
    if i % 2 == 0:
        return encode_frame(REQUEST, RequestCode.CREATE_TOPIC, 1, {"topic": name, "queues": 4})
    return encode_frame(REQUEST, RequestCode.DELETE_TOPIC, 1, {"topic": name})


async def churn_topics(addr: str, size: int, stop: asyncio.Event) -> int:
    """Rounds of ``size`` pipelined topic creations and deletions until ``stop``; the
    operations done."""
    done = 0
    while not stop.is_set():
        count = Count("topics: changes", size)
        await pipelined(addr, [topic_change(i) for i in range(size)], count)
        done += size
    return done


async def scenario_run(addr: str, scenario: str, size: int, seconds: float) -> dict:
    from onceq import Admin

    if scenario == "topics":
        stop = asyncio.Event()
        churn = asyncio.create_task(churn_topics(addr, size, stop))
        lat = sorted(await pings(addr, seconds))
        stop.set()
        return {"size": size, "operations": await churn, **summary(lat)}
    async with Admin(addr) as admin:
        await admin.create_topic(TOPIC, QUEUES)
    count = Count(f"{scenario}: load", size)
    if scenario == "writers":
        frames = [sequenced(f"w{i // QUEUES}", i % QUEUES, 1) for i in range(size)]
    else:
        frames = [commit(f"g{i // QUEUES}", i % QUEUES, 0) for i in range(size)]
    per = (len(frames) + 3) // 4
    await asyncio.gather(*(pipelined(addr, frames[i * per:(i + 1) * per], count)
                           for i in range(4)))
    count.done()
    await asyncio.sleep(1.5)  # the first large snapshot is written
    stop = asyncio.Event()
    changer = asyncio.create_task(keep_changing(addr, scenario, stop))
    lat = sorted(await pings(addr, seconds))
    stop.set()
    await changer
    return {"size": size, **summary(lat)}


def summary(lat: list[float]) -> dict:
    return {"pings": len(lat), "p50_ms": round(1000 * statistics.median(lat), 2),
            "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2),
            "max_ms": round(1000 * lat[-1], 2)}


def child(scenario: str, size: int, seconds: float) -> None:
    from throughput import start_broker

    with tempfile.TemporaryDirectory(prefix="onceq-stall-") as d:
        proc, addr = start_broker(os.path.join(d, "data"), "async")
        try:
            print(json.dumps(asyncio.run(scenario_run(addr, scenario, size, seconds))))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=200_000)
    ap.add_argument("--offsets", type=int, default=160_000)
    ap.add_argument("--topics", type=int, default=2000)
    ap.add_argument("--only", choices=("writers", "offsets", "topics"), nargs="+")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--src", nargs="+", default=[SRC])
    ap.add_argument("--child", nargs=3, metavar=("SCENARIO", "SIZE", "SECONDS"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), float(a.child[2]))
        return
    srcs = [os.path.abspath(s) for s in a.src]
    report: dict = {"seconds": a.seconds, "src": srcs, "results": {}}
    scenarios = [(sc, size) for sc, size in (("writers", a.writers), ("offsets", a.offsets),
                                            ("topics", a.topics))
                 if a.only is None or sc in a.only]
    steps = Steps(len(scenarios) * len(srcs))
    for scenario, size in scenarios:
        for src in srcs:
            steps.next(f"{scenario} ({size}) on {src}")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                p for p in (src, os.environ.get("PYTHONPATH")) if p))
            out = subprocess.run([sys.executable, __file__, "--child", scenario, str(size),
                                  str(a.seconds)], env=env, stdout=subprocess.PIPE, text=True,
                                 check=True, timeout=1800)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            note(f"  ping p99 {res['p99_ms']} ms, max {res['max_ms']} ms")
            report["results"].setdefault(scenario, {})[src] = res
    report["goal_p99_under_50ms"] = {
        sc: {s: r["p99_ms"] < 50 for s, r in by.items()}
        for sc, by in report["results"].items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
