"""The official RocketMQ 5 Python client next to onceq's own SDK, on one broker.

One broker (``onceq broker start --grpc-port``, async flush) in its own process; every
client in a process of its own, timed inside that process after a warm-up; 100-byte bodies;
topics of ``--queues`` queues. The official client is ``rocketmq-python-client`` (the dev
extra), driven by ``tests/rocketmq/rmq_load.py`` (its ``rocketmq`` package cannot share a
process with onceq's protocol descriptors).

Produce, ``--n`` messages each, every figure on a topic of its own:

* ``official_send``: ``Producer.send`` (blocking, one message in flight);
* ``official_send_async``: ``Producer.send_async``, ``--in-flight`` futures outstanding;
* ``onceq_sync_send``: onceq's ``SyncProducer.send`` (blocking, one in flight);
* ``onceq_async_send``: onceq's ``Producer.send``, ``--in-flight`` sends outstanding.

Consume, ``--n`` messages stored beforehand (onceq's ``send_batch``), each consumer a group
of its own from the topic's first offset:

* ``official_simple_ack``: a SimpleConsumer, ``receive`` of 32 (invisible 60 s), ``ack``
  of each message (one acknowledgement in flight);
* ``official_simple_ack_async``: the same, ``--in-flight`` acknowledgements outstanding
  (``ack`` on as many threads: the client's ``ack_async`` returns no future in 5.1.2);
* ``onceq_push``: onceq's ``PushConsumer`` (its defaults: pull batch 32, a listener call
  per message, 20 at once; offsets committed in the background), a no-op async listener;
* ``onceq_pull``: onceq's ``PullConsumer``, a prefetching stream of pulls of 32 per queue,
  each pull committing the offset consumed before it.

Throughput is messages per second (for consumers: distinct messages, every body read); each
figure is the median of ``--repeats`` runs, each run on a fresh broker. ``ratios``: the
official client's figure over onceq's for the comparable pair (below 1: the official client
is slower on onceq than onceq's own SDK).

Usage: python benchmarks/rocketmq_clients.py [--n 10000] [--repeats 3] [--in-flight 64]
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _progress import Steps, note  # noqa: E402
from throughput import _free_port, start_broker  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from tests.helpers import wait_port  # noqa: E402

LOAD = HERE.parent / "tests" / "rocketmq" / "rmq_load.py"
BODY = 100
WARMUP = 200
PRODUCE = ("official_send", "official_send_async", "onceq_sync_send", "onceq_async_send")
CONSUME = ("official_simple_ack", "official_simple_ack_async", "onceq_push", "onceq_pull")
RATIOS = {
    "produce_send_vs_onceq_sync_send": ("official_send", "onceq_sync_send"),
    "produce_send_async_vs_onceq_async_send": ("official_send_async", "onceq_async_send"),
    "consume_simple_ack_vs_onceq_push": ("official_simple_ack", "onceq_push"),
    "consume_simple_ack_async_vs_onceq_push": ("official_simple_ack_async", "onceq_push"),
    "consume_simple_ack_async_vs_onceq_pull": ("official_simple_ack_async", "onceq_pull"),
}




# ---------------------------------------------------------------- onceq's side (children)
async def _onceq_produce(addr: str, topic: str, n: int, in_flight: int) -> float:
    from onceq import Producer, SyncProducer

    body = b"x" * BODY
    if in_flight <= 1:  # the blocking producer, as the official send
        p = SyncProducer(addr)
        try:
            for _ in range(WARMUP):
                p.send(topic, body)
            t0 = time.perf_counter()
            for _ in range(n):
                p.send(topic, body)
            return n / (time.perf_counter() - t0)
        finally:
            p.close()
    async with Producer(addr) as ap:
        for _ in range(WARMUP):
            await ap.send(topic, body)
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await ap.send(topic, body)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return n / (time.perf_counter() - t0)


async def _onceq_push(addr: str, topic: str, n: int) -> float:
    from onceq import PushConsumer

    seen: set[str] = set()
    size = 0
    done = asyncio.Event()
    t0 = 0.0

    async def listener(msgs: list[Any], ctx: Any) -> None:
        nonlocal size, t0
        t0 = t0 or time.perf_counter()
        for m in msgs:
            size += len(m.body)
            seen.add(m.unique_key)
        if len(seen) >= n:
            done.set()

    c = PushConsumer(addr, "bench-onceq-push", listener, consume_from="FIRST")
    c.subscribe(topic)
    start = time.perf_counter()
    await c.start()
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - min(t0 or start, start)
    await c.shutdown()
    _check(size, len(seen), n)
    return n / elapsed


async def _onceq_pull(addr: str, topic: str, n: int, queues: int) -> float:
    from onceq import PullConsumer

    got = size = 0
    done = asyncio.Event()
    async with PullConsumer(addr, "bench-onceq-pull") as c:
        async def one(q: int) -> None:
            nonlocal got, size
            async for r in c.stream(topic, q, 0, 32, suspend=1.0):
                for m in r.messages:
                    size += len(m.body)
                got += len(r.messages)
                if got >= n:
                    done.set()

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(q)) for q in range(queues)]
        await asyncio.wait_for(done.wait(), 600)
        elapsed = time.perf_counter() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    _check(size, got, n)
    return n / elapsed


def _check(size: int, got: int, n: int) -> None:
    if got < n or size < n * BODY:
        raise AssertionError(f"consumed {got} messages, {size} body bytes, of {n}")


def _child(role: str, addr: str, topic: str, n: int, extra: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if role == "produce":
        rate = asyncio.run(_onceq_produce(addr, topic, n, extra))
    elif role == "push":
        rate = asyncio.run(_onceq_push(addr, topic, n))
    else:
        rate = asyncio.run(_onceq_pull(addr, topic, n, extra))
    print(json.dumps({"rate": rate}), flush=True)


def _run(argv: list[str], home: str) -> dict[str, Any]:
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=900,  # stderr:
                         env={**os.environ, "HOME": home})  # progress and errors, shown
    if out.returncode != 0:
        raise RuntimeError(f"{argv[1:4]} failed (exit {out.returncode}): see above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _official(endpoint: str, home: str, command: str, **args: Any) -> float:
    return _run([sys.executable, str(LOAD), endpoint, command, json.dumps(args)],
                home)["rate"]


def _onceq(home: str, role: str, addr: str, topic: str, n: int, extra: int) -> float:
    return _run([sys.executable, __file__, "--child", role, addr, topic, str(n), str(extra)],
                home)["rate"]


# ---------------------------------------------------------------- one run
async def _setup(addr: str, queues: int, n: int) -> None:
    from onceq import Admin, Producer

    async with Admin(addr) as a:
        for name in (*PRODUCE, "consume"):
            await a.create_topic(f"bench-{name}", queues)
    body = b"x" * BODY
    async with Producer(addr) as p:
        for i in range(0, n, 100):
            await p.send_batch("bench-consume", [body] * min(100, n - i), queue=(i // 100)
                               % queues)


def run_once(n: int, queues: int, in_flight: int, steps: Steps) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="onceq-rmq-bench-") as d:
        gport = _free_port()
        proc, addr = start_broker(os.path.join(d, "data"), "async",
                                  ["--grpc-port", str(gport)])
        try:
            wait_port(gport)
            endpoint = f"127.0.0.1:{gport}"
            asyncio.run(_setup(addr, queues, n))
            res: dict[str, float] = {}
            for name in (*PRODUCE, *CONSUME):
                steps.next(name)
                topic = "bench-consume" if name in CONSUME else f"bench-{name}"
                if name == "official_send":
                    r = _official(endpoint, d, "bench_produce", topic=topic, n=n, size=BODY,
                                  warmup=WARMUP)
                elif name == "official_send_async":
                    r = _official(endpoint, d, "bench_produce", topic=topic, n=n, size=BODY,
                                  warmup=WARMUP, in_flight=in_flight)
                elif name == "onceq_sync_send":
                    r = _onceq(d, "produce", addr, topic, n, 1)
                elif name == "onceq_async_send":
                    r = _onceq(d, "produce", addr, topic, n, in_flight)
                elif name == "official_simple_ack":
                    r = _official(endpoint, d, "bench_simple", topic=topic, n=n, batch=32,
                                  group="bench-simple-ack")
                elif name == "official_simple_ack_async":
                    r = _official(endpoint, d, "bench_simple", topic=topic, n=n, batch=32,
                                  group="bench-simple-ack-async", ack_in_flight=in_flight)
                elif name == "onceq_push":
                    r = _onceq(d, "push", addr, topic, n, 0)
                else:
                    r = _onceq(d, "pull", addr, topic, n, queues)
                note(f"  {name}: {r:.0f} msgs/s")
                res[name] = r
            return res
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--child", nargs=5, metavar=("ROLE", "ADDR", "TOPIC", "N", "EXTRA"))
    a = ap.parse_args()
    if a.child:
        role, addr, topic, n, extra = a.child
        _child(role, addr, topic, int(n), int(extra))
        return
    if not LOAD.exists():
        raise SystemExit(f"{LOAD} is missing")
    steps = Steps(a.repeats * (len(PRODUCE) + len(CONSUME)))
    runs = [run_once(a.n, a.queues, a.in_flight, steps) for _ in range(a.repeats)]
    med = {k: round(statistics.median(r[k] for r in runs)) for k in (*PRODUCE, *CONSUME)}
    report = {
        "workload": {"n": a.n, "body_bytes": BODY, "queues": a.queues,
                     "in_flight": a.in_flight, "repeats": a.repeats, "flush": "async",
                     "official_client": _client_version()},
        "produce_msgs_per_s": {k: med[k] for k in PRODUCE},
        "consume_msgs_per_s": {k: med[k] for k in CONSUME},
        "ratios_official_over_onceq": {k: round(med[x] / med[y], 3)
                                       for k, (x, y) in RATIOS.items()},
        "runs": runs if a.repeats > 1 else None,
    }
    if report["runs"]:
        report["runs"] = [{k: round(v) for k, v in r.items()} for r in runs]
    print(json.dumps(report, indent=2))


def _client_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rocketmq-python-client")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
