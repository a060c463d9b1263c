"""Produce and consume throughput of onceq next to Redis Streams and NATS JetStream.

Workload: 100-byte bodies; batches of 1, 32 and 100 messages per request; the broker in its
own process (``onceq broker start``), one producer process, then one consumer process that
pulls with offset commits piggy-backed on every pull. The produce phase is timed in the
producer process and the consume phase in the consumer process, exactly as the peers are
measured by ``peers.py``. One topic with one queue (one Redis stream, one JetStream stream).
Each figure is the median of ``--repeats`` runs, each run on a fresh broker data directory.
The sync flush is also set against Redis fsyncing every write (``redis-always`` in
``peers.py``: a redis-server started for the run with ``appendfsync always``), produce at
batch 100, under ``ratios``.

Usage: python benchmarks/throughput.py [--n 200000] [--repeats 3] [--no-peers]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402

BODY = 100
TOPIC = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(data_dir: str, flush: str, extra: list[str] | None = None
                 ) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    os.makedirs(data_dir, exist_ok=True)
    err = open(os.path.join(data_dir, "broker.err"), "w+")  # noqa: SIM115 - read on failure
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceq.cli.main", "broker", "start", "--data-dir", data_dir,
         "--port", str(port), "--flush", flush, "--log-level", "WARNING", *(extra or [])],
        stdout=subprocess.DEVNULL, stderr=err,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    err.seek(0)
    raise RuntimeError(f"broker did not start: {err.read()[-2000:]}")


# ---------------------------------------------------------------- child roles
async def _produce(addr: str, n: int, batch: int) -> float:
    from onceq import Admin, Producer

    async with Admin(addr) as admin:
        await admin.create_topic(TOPIC, 1)
    body = b"x" * BODY
    count = Count(f"produce batch={batch}", n)
    async with Producer(addr) as p:
        await p.send(TOPIC, body)  # warm-up: route lookup, connection
        sent = 1
        t0 = time.perf_counter()
        if batch == 1:
            while sent < n:
                await p.send(TOPIC, body)
                sent += 1
                count.add()
        else:
            msgs = [body] * batch
            while sent < n:
                k = min(batch, n - sent)
                await p.send_batch(TOPIC, msgs[:k])
                sent += k
                count.add(k)
        elapsed = time.perf_counter() - t0
    count.done()
    return (n - 1) / elapsed


async def _consume(addr: str, n: int, batch: int) -> float:
    from onceq import PullConsumer

    count = Count(f"consume batch={batch}", n)
    async with PullConsumer(addr, "bench-group") as c:
        got = 0
        size = 0
        offset = 0
        t0 = time.perf_counter()
        # one pull in flight ahead (prefetch); each pull commits what was consumed before.
        # Every body is read, as a consumer would (and as the peers' clients hand them over)
        async for r in c.stream(TOPIC, 0, 0, batch, suspend=1.0):
            for m in r.messages:
                size += len(m.body)
            got += len(r.messages)
            count.add(len(r.messages))
            offset = r.next_offset
            if got >= n:
                break
        await c.commit_offset(TOPIC, 0, offset)
        elapsed = time.perf_counter() - t0
    count.done()
    if size != got * BODY:
        raise AssertionError(f"consumed {size} body bytes for {got} messages of {BODY}")
    return got / elapsed


def _child(role: str, addr: str, n: int, batch: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    fn = _produce if role == "produce" else _consume
    print(json.dumps({"rate": asyncio.run(fn(addr, n, batch))}))


def _run_child(role: str, addr: str, n: int, batch: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", role, addr, str(n), str(batch)],
        stdout=subprocess.PIPE, text=True, timeout=600, check=True,  # progress: stderr
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


def run_onceq(n: int, batches: list[int], flush: str, repeats: int, steps: Steps,
              broker_args: list[str] | None = None) -> dict:
    res: dict = {"produce": {}, "consume": {}, "n": {}}
    for b in batches:
        nb = n if b > 1 else max(n // 10, 1000)
        prod, cons = [], []
        for r in range(repeats):
            steps.next(f"onceq flush={flush}: batch={b}, n={nb}, run {r + 1}/{repeats}")
            with tempfile.TemporaryDirectory(prefix="onceq-bench-") as d:
                proc, addr = start_broker(d, flush, broker_args)
                try:
                    prod.append(_run_child("produce", addr, nb, b))
                    cons.append(_run_child("consume", addr, nb, b))
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
        res["produce"][str(b)] = round(statistics.median(prod))
        res["consume"][str(b)] = round(statistics.median(cons))
        res["n"][str(b)] = nb
    return res


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--batches", default="1,32,100")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--broker-args", default="",
                    help="extra 'onceq broker start' flags, e.g. '--metrics-port 0'")
    ap.add_argument("--child", nargs=4, metavar=("ROLE", "ADDR", "N", "BATCH"))
    a = ap.parse_args()
    if a.child:
        role, addr, n, batch = a.child
        _child(role, addr, int(n), int(batch))
        return
    batches = [int(b) for b in a.batches.split(",")]
    report: dict = {"workload": {"body_bytes": BODY, "n": a.n, "batches": batches,
                                 "repeats": a.repeats, "queues": 1}}
    if a.broker_args:
        report["workload"]["broker_args"] = a.broker_args
    steps = Steps(2 * len(batches) * a.repeats)
    onceq = {flush: run_onceq(a.n, batches, flush, a.repeats, steps, a.broker_args.split())
             for flush in ("async", "sync")}
    report["onceq"] = onceq
    peers: dict = {}
    if not a.no_peers:
        from peers import run_peers

        note("peers: Redis Streams (also with appendfsync always) and NATS JetStream, "
             "same workload")
        peers = run_peers(a.n, batches, a.repeats, BODY)
    report["peers"] = peers
    ratios: dict = {}
    for name, p in peers.items():
        if not p.get("available"):
            continue
        for phase in ("produce", "consume"):
            for b in batches:
                key = f"{phase}_{b}_async_vs_{name}"
                ratios[key] = _ratio(onceq["async"][phase].get(str(b)),
                                     p[phase].get(str(b)))
    always = peers.get("redis-always", {})
    if always.get("available"):
        ratios["sync flush batch 100 vs Redis appendfsync always pipelined 100"] = _ratio(
            onceq["sync"]["produce"].get("100"), always["produce"].get("100"))
    report["ratios"] = ratios
    r, nt = peers.get("redis", {}), peers.get("nats", {})
    report["goals"] = {
        "produce_100_async_vs_redis_xadd_100 >= 1.0": ratios.get("produce_100_async_vs_redis")
        if r.get("available") else None,
        "produce_100_async_vs_nats_publish_async >= 3.0": ratios.get(
            "produce_100_async_vs_nats") if nt.get("available") else None,
        "produce_100_sync >= 50000": onceq["sync"]["produce"].get("100"),
        "consume_100_vs_redis_xreadgroup_100 >= 1.0": ratios.get("consume_100_async_vs_redis")
        if r.get("available") else None,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
