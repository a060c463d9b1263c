"""End-to-end latency (send to listener) at fixed offered rates: onceq next to its peers.

Systems: onceq with async and with sync flush (a fresh broker each run, ``onceq broker
start``, one topic with one queue), Redis Streams (XADD; XREADGROUP BLOCK then XACK),
NATS JetStream (file stream; publish awaiting its ack; a push subscription with explicit
acks) and RabbitMQ quorum queues (publisher confirms; a consumer acknowledging each
message). A system whose server does not answer on loopback is reported as unavailable.

Workload, the same for every system: 100-byte bodies; the producer and the consumer each
in its own process (own event loop, uvloop when installed); the consumer is ready (queue
assigned, subscription made) before the producer starts. Each message is one send request
(no client-side batching): message ``i`` is due at ``t0 + i / rate`` on an absolute
schedule and is sent then without waiting for earlier acknowledgements (open loop), with
at most ``IN_FLIGHT`` sends outstanding; a producer that falls behind sends the overdue
messages at once. onceq sends with ``Producer.send``; its consumer is a ``PushConsumer``
with a no-op listener (listener batch 1, the default settings otherwise).

Latency is measured from the *scheduled* send time, not from the moment the send was
issued, so a producer or a system that falls behind pays for every message it delays
(coordinated omission is accounted for). The body carries the message's sequence number
and its scheduled send time as ``time.time_ns()`` (the wall clock, the one clock shared by
the two processes); the consumer stamps ``time.time_ns()`` as each message reaches its
listener. The event loop's timers have a resolution of 1 ms, so messages due within the
same millisecond leave together; that adds at most about 1 ms to each figure, the same for
every system, and is reported as ``issue_lag_ms`` (how late after its scheduled time each
send was issued, warm-up excluded).

Warm-up is excluded: the messages scheduled in the first second or the first 5% of the run,
whichever is longer. Reported per system and rate: the achieved rate (acknowledged sends
per second from the first scheduled send to the last acknowledgement) and p50 / p99 /
p99.9 / max latency in milliseconds. The figures are printed only once every run has
passed the check that every message sent was received exactly once; otherwise the script
fails with the list of violations.

Usage: python benchmarks/latency.py [--rates 1000,10000] [--seconds 10]
           [--systems onceq-async,onceq-sync,redis,nats,rabbitmq]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Count, Steps, note  # noqa: E402

BODY = 100
HEAD = struct.Struct("<qq")  # sequence number, scheduled send time (ns since the epoch)
PAD = b"x" * (BODY - HEAD.size)
IN_FLIGHT = 64  # sends outstanding at most, per producer
TOPIC = "latency"
GROUP = "latency"
MIN_SLEEP = 0.001  # the loop's timer resolution: shorter sleeps would spin
IDLE_TIMEOUT = 10.0  # seconds without a message before a consumer gives up
GRACE = 1.0  # seconds a consumer keeps listening after the last message, for duplicates
WARMUP_SECONDS = 1.0
WARMUP_SHARE = 0.05
SYSTEMS = ("onceq-async", "onceq-sync", "redis", "nats", "rabbitmq")
REDIS_URL = "redis://127.0.0.1:6379"
NATS_URL = "nats://127.0.0.1:4222"
AMQP_HOST, AMQP_PORT = "127.0.0.1", 5672
AMQP_URL = f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/"

Send = Callable[[bytes], Awaitable[Any]]
Receive = Callable[[bytes], None]
Target = dict[str, Any]


def encode(seq: int, scheduled_ns: int) -> bytes:
    """A body of ``BODY`` bytes starting with the sequence number and the scheduled time."""
    return HEAD.pack(seq, scheduled_ns) + PAD


def warmup_count(n: int, rate: int) -> int:
    """How many leading messages are warm-up: the first second or the first 5%."""
    return min(n, max(math.ceil(n * WARMUP_SHARE), math.ceil(rate * WARMUP_SECONDS)))


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p99 / p999 / max (nearest rank) of ``values`` in ns, as milliseconds."""
    if not values:
        return {"p50": None, "p99": None, "p999": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)] / 1e6, 3)

    return {"p50": rank(0.5), "p99": rank(0.99), "p999": rank(0.999),
            "max": round(ordered[-1] / 1e6, 3)}


# --------------------------------------------------------------------------- producer side


class OpenLoop:
    """Sends ``n`` messages at ``rate`` on an absolute schedule, not awaiting earlier acks."""

    def __init__(self, send: Send, n: int, rate: int) -> None:
        self.send, self.n, self.rate = send, n, rate
        self.warm = warmup_count(n, rate)
        self.slots = asyncio.Semaphore(IN_FLIGHT)
        self.pending: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []
        self.acked = 0
        self.last_ack = 0.0
        self.lags: list[float] = []
        self.count = Count(f"sent at {rate}/s", n)

    async def _one(self, body: bytes) -> None:
        try:
            await self.send(body)
        except Exception as exc:  # counted; the exactly-once check reports it
            self.errors.append(repr(exc))
        else:
            self.acked += 1
            self.last_ack = time.perf_counter()
        finally:
            self.slots.release()

    async def run(self) -> dict[str, Any]:
        """Send everything, wait for every acknowledgement; the producer's figures."""
        start, wall0 = time.perf_counter(), time.time_ns()
        for i in range(self.n):
            due = start + i / self.rate
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(max(wait, MIN_SLEEP))
            await self.slots.acquire()
            if i >= self.warm:
                self.lags.append((time.perf_counter() - due) * 1e9)
            task = asyncio.create_task(self._one(encode(i, wall0 + i * 1_000_000_000
                                                        // self.rate)))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
            self.count.add()
        await asyncio.gather(*self.pending)
        self.count.done()
        return self.summary(start)

    def summary(self, start: float) -> dict[str, Any]:
        elapsed = max(self.last_ack - start, 1e-9)
        lag = percentiles(self.lags)
        return {"sent": self.n, "acked": self.acked, "errors": len(self.errors),
                "first_errors": self.errors[:3],
                "achieved_rate": round(self.acked / elapsed, 1) if self.acked else 0.0,
                "issue_lag_ms": {"p50": lag["p50"], "p99": lag["p99"], "max": lag["max"]}}


@contextlib.asynccontextmanager
async def onceq_sender(target: Target) -> AsyncIterator[Send]:
    from onceq import Producer

    async with Producer(target["addr"]) as p:
        await p.queue_count(TOPIC)  # route lookup and connection, before the schedule
        yield functools.partial(p.send, TOPIC)


@contextlib.asynccontextmanager
async def redis_sender(target: Target) -> AsyncIterator[Send]:
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool.from_url(REDIS_URL, max_connections=IN_FLIGHT)
    r = aioredis.Redis(connection_pool=pool)
    try:
        await r.ping()
        key = target["key"]
        yield lambda body: r.xadd(key, {"d": body})
    finally:
        await r.aclose()
        await pool.disconnect()


@contextlib.asynccontextmanager
async def nats_sender(target: Target) -> AsyncIterator[Send]:
    import nats

    nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        subject = target["subject"]
        yield lambda body: js.publish(subject, body)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def rabbitmq_sender(target: Target) -> AsyncIterator[Send]:
    import aio_pika

    conn = await aio_pika.connect(AMQP_URL, timeout=5)
    try:
        channel = await conn.channel(publisher_confirms=True)
        exchange, queue = channel.default_exchange, target["queue"]

        def send(body: bytes) -> Awaitable[Any]:
            msg = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            return exchange.publish(msg, routing_key=queue, timeout=IDLE_TIMEOUT)

        yield send
    finally:
        await conn.close()


# --------------------------------------------------------------------------- consumer side


class Receipts:
    """What a consumer received: per sequence number, the latency of its first copy."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.latency = array("q", bytes(8 * n))
        self.seen = bytearray(n)
        self.unique = self.duplicates = self.strays = 0
        self.last = time.monotonic()
        self.complete = asyncio.Event()

    def add(self, body: bytes) -> None:
        """The listener: stamp the receive time of one body."""
        now = time.time_ns()
        self.last = time.monotonic()
        seq, scheduled = HEAD.unpack_from(body)
        if not 0 <= seq < self.n:
            self.strays += 1
        elif self.seen[seq]:
            self.duplicates += 1
        else:
            self.seen[seq] = 1
            self.latency[seq] = now - scheduled
            self.unique += 1
            if self.unique == self.n:
                self.complete.set()

    async def finished(self) -> None:
        """Return ``GRACE`` s after the last message, or after ``IDLE_TIMEOUT`` s of silence."""
        while not self.complete.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.complete.wait(), 0.5)
            if time.monotonic() - self.last > IDLE_TIMEOUT:
                return
        await asyncio.sleep(GRACE)

    def summary(self, warm: int) -> dict[str, Any]:
        measured = [self.latency[i] for i in range(warm, self.n) if self.seen[i]]
        return {"received": self.unique + self.duplicates + self.strays,
                "unique": self.unique, "duplicates": self.duplicates, "strays": self.strays,
                "missing": self.n - self.unique, "measured": len(measured),
                "latency_ms": percentiles(measured)}


@contextlib.asynccontextmanager
async def onceq_receiver(target: Target, receive: Receive) -> AsyncIterator[None]:
    from onceq.client.push import PushConsumer

    async def listener(msgs: list[Any], ctx: Any) -> None:
        for m in msgs:
            receive(m.body)

    c = PushConsumer(target["addr"], GROUP, listener, consume_from="FIRST")
    c.subscribe(TOPIC)
    await c.start()
    try:
        deadline = time.monotonic() + 30
        while not c.assignment and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not c.assignment:
            raise RuntimeError("the push consumer got no queue within 30 s")
        yield
    finally:
        await c.shutdown()


@contextlib.asynccontextmanager
async def redis_receiver(target: Target, receive: Receive) -> AsyncIterator[None]:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(REDIS_URL)
    key = target["key"]

    async def loop() -> None:
        while True:
            resp = await r.xreadgroup(GROUP, "c1", {key: ">"}, count=100, block=1000)
            ids = []
            for _stream, entries in resp or ():
                for mid, fields in entries:
                    receive(fields[b"d"])
                    ids.append(mid)
            if ids:
                await r.xack(key, GROUP, *ids)

    await r.ping()
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await r.aclose()


@contextlib.asynccontextmanager
async def nats_receiver(target: Target, receive: Receive) -> AsyncIterator[None]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)

    async def on_msg(msg: Any) -> None:
        receive(msg.data)
        await msg.ack()

    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=10_000,
                                deliver_policy=DeliverPolicy.ALL)
        sub = await js.subscribe(target["subject"], durable=GROUP, stream=target["stream"],
                                 cb=on_msg, manual_ack=True, config=config)
        yield
        await sub.unsubscribe()
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def rabbitmq_receiver(target: Target, receive: Receive) -> AsyncIterator[None]:
    import aio_pika

    conn = await aio_pika.connect(AMQP_URL, timeout=5)

    async def on_msg(msg: Any) -> None:
        receive(msg.body)
        await msg.ack()

    try:
        channel = await conn.channel()
        await channel.set_qos(prefetch_count=IN_FLIGHT * 4)
        queue = await channel.get_queue(target["queue"], ensure=True)
        tag = await queue.consume(on_msg, no_ack=False)
        yield
        await queue.cancel(tag)
    finally:
        await conn.close()


SENDERS: dict[str, Callable[[Target], contextlib.AbstractAsyncContextManager[Send]]] = {
    "onceq": onceq_sender, "redis": redis_sender, "nats": nats_sender,
    "rabbitmq": rabbitmq_sender,
}
RECEIVERS: dict[str, Callable[[Target, Receive], contextlib.AbstractAsyncContextManager[None]]] = {
    "onceq": onceq_receiver, "redis": redis_receiver, "nats": nats_receiver,
    "rabbitmq": rabbitmq_receiver,
}


def _family(system: str) -> str:
    return "onceq" if system.startswith("onceq") else system


async def produce(system: str, target: Target, n: int, rate: int) -> dict[str, Any]:
    async with SENDERS[_family(system)](target) as send:
        return await OpenLoop(send, n, rate).run()


async def consume(system: str, target: Target, n: int, rate: int) -> dict[str, Any]:
    receipts = Receipts(n)
    async with RECEIVERS[_family(system)](target, receipts.add):
        print("ready", flush=True)
        await receipts.finished()
    return receipts.summary(warmup_count(n, rate))


def child_main(role: str, system: str, spec: str) -> None:
    """A producer or consumer process: run, then print its figures as one JSON line."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    args = json.loads(spec)
    fn = produce if role == "produce" else consume
    print(json.dumps(asyncio.run(fn(system, args["target"], args["n"], args["rate"]))),
          flush=True)


# --------------------------------------------------------------------------- parent side


def _probe(host: str, port: int, hello: bytes, expect: bytes) -> bool:
    """True if ``host:port`` answers ``hello`` with a reply starting with ``expect``."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.settimeout(0.5)
            if hello:
                s.sendall(hello)
            return s.recv(64).startswith(expect)
    except OSError:
        return False


def available(systems: list[str]) -> dict[str, bool]:
    """Which systems can run now: onceq always (a broker is started), peers if they answer."""
    from peers import available as peers_up

    up = peers_up()
    try:
        import aio_pika  # noqa: F401

        amqp = _probe(AMQP_HOST, AMQP_PORT, b"AMQP\x00\x00\x09\x01", b"\x01\x00\x00")
    except ImportError:
        amqp = False
    known = {"redis": up.get("redis", False), "nats": up.get("nats", False),
             "rabbitmq": amqp}
    return {s: known.get(s, True) for s in systems}


@contextlib.contextmanager
def onceq_target(flush: str) -> Iterator[Target]:
    from throughput import start_broker

    from onceq import Admin

    async def create(addr: str) -> None:
        async with Admin(addr) as admin:
            await admin.create_topic(TOPIC, 1)

    with tempfile.TemporaryDirectory(prefix="onceq-latency-") as d:
        proc, addr = start_broker(d, flush)
        try:
            asyncio.run(create(addr))
            yield {"addr": addr}
        finally:
            proc.terminate()
            proc.wait(timeout=60)


@contextlib.contextmanager
def redis_target() -> Iterator[Target]:
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    key = f"onceq-latency-{uuid.uuid4().hex[:12]}"
    try:
        r.xgroup_create(key, GROUP, id="0", mkstream=True)
        yield {"key": key}
    finally:
        r.delete(key)
        r.close()


async def _nats_stream(action: str, stream: str, subject: str) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream(timeout=IDLE_TIMEOUT)
        if action == "create":
            await js.add_stream(StreamConfig(name=stream, subjects=[subject],
                                             storage=StorageType.FILE))
        else:
            await js.delete_stream(stream)
    finally:
        await nc.close()


@contextlib.contextmanager
def nats_target() -> Iterator[Target]:
    stream = f"onceq_latency_{uuid.uuid4().hex[:12]}"
    subject = f"{stream}.msgs"
    asyncio.run(_nats_stream("create", stream, subject))
    try:
        yield {"stream": stream, "subject": subject}
    finally:
        asyncio.run(_nats_stream("delete", stream, subject))


async def _rabbitmq_queue(action: str, name: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(AMQP_URL, timeout=5)
    try:
        channel = await conn.channel()
        if action == "create":
            await channel.declare_queue(name, durable=True,
                                        arguments={"x-queue-type": "quorum"})
        else:
            await channel.queue_delete(name)
    finally:
        await conn.close()


@contextlib.contextmanager
def rabbitmq_target() -> Iterator[Target]:
    name = f"onceq-latency-{uuid.uuid4().hex[:12]}"
    asyncio.run(_rabbitmq_queue("create", name))
    try:
        yield {"queue": name}
    finally:
        asyncio.run(_rabbitmq_queue("delete", name))


TARGETS: dict[str, Callable[[], contextlib.AbstractContextManager[Target]]] = {
    "onceq-async": functools.partial(onceq_target, "async"),
    "onceq-sync": functools.partial(onceq_target, "sync"),
    "redis": redis_target, "nats": nats_target, "rabbitmq": rabbitmq_target,
}


def _child_cmd(role: str, system: str, target: Target, n: int, rate: int) -> list[str]:
    spec = json.dumps({"target": target, "n": n, "rate": rate})
    return [sys.executable, os.path.abspath(__file__), "--child", role, system, spec]


def _last_json(text: str, what: str) -> dict[str, Any]:
    lines = text.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{what} printed no result")
    return json.loads(lines[-1])


def run_one(system: str, rate: int, seconds: float) -> dict[str, Any]:
    """One system at one rate: a consumer process, then a producer process; both figures."""
    n = max(1, round(rate * seconds))
    budget = seconds * 3 + 120
    with TARGETS[system]() as target:
        consumer = subprocess.Popen(_child_cmd("consume", system, target, n, rate),
                                    stdout=subprocess.PIPE, text=True)
        try:
            if consumer.stdout is None or consumer.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{system} consumer did not start")
            prod = subprocess.run(_child_cmd("produce", system, target, n, rate),
                                  stdout=subprocess.PIPE, text=True, timeout=budget,
                                  check=True)
            out, _ = consumer.communicate(timeout=budget)
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
    return {"offered_rate": rate, "n": n, "warmup": warmup_count(n, rate),
            "producer": _last_json(prod.stdout, "producer"),
            "consumer": _last_json(out, "consumer")}


def violations(system: str, rate: int, run: dict[str, Any]) -> list[str]:
    """Why a run fails the exactly-once check (empty: every message received once)."""
    if "error" in run:
        return [f"{system} @ {rate}/s: {run['error']}"]
    p, c, n = run["producer"], run["consumer"], run["n"]
    checks = {"sends acknowledged": p["acked"] == n and not p["errors"],
              "every message received": c["unique"] == n and c["missing"] == 0,
              "no duplicates": c["duplicates"] == 0, "no strays": c["strays"] == 0}
    return [f"{system} @ {rate}/s: not {name} (producer {p}, consumer {c})"
            for name, ok in checks.items() if not ok]


def figures(run: dict[str, Any]) -> dict[str, Any]:
    p, c = run["producer"], run["consumer"]
    return {"offered_rate": run["offered_rate"], "achieved_rate": p["achieved_rate"],
            "messages": run["n"], "warmup_excluded": run["warmup"], "measured": c["measured"],
            "received_once": c["unique"], "latency_ms": c["latency_ms"],
            "issue_lag_ms": p["issue_lag_ms"]}


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """onceq async p99 at 1,000 msg/s: at most 5 ms, and at most JetStream's p99."""

    def p99(system: str) -> float | None:
        run = results.get(system, {}).get("1000")
        return run["latency_ms"]["p99"] if run else None

    mine, theirs = p99("onceq-async"), p99("nats")
    return {
        "onceq-async p99 at 1000 msg/s <= 5 ms": {
            "p99_ms": mine, "met": None if mine is None else mine <= 5.0},
        "onceq-async p99 at 1000 msg/s <= nats p99": {
            "p99_ms": mine, "nats_p99_ms": theirs,
            "met": None if mine is None or theirs is None else mine <= theirs},
    }


def run_all(systems: list[str], rates: list[int], seconds: float) -> tuple[dict, list[str]]:
    """Every available system at every rate; the results and the check's violations."""
    up = available(systems)
    steps = Steps(sum(up.values()) * len(rates))
    results: dict[str, Any] = {}
    problems: list[str] = []
    for system in systems:
        if not up[system]:
            note(f"{system}: not available, skipped")
            results[system] = {"available": False}
            continue
        entry: dict[str, Any] = {"available": True}
        for rate in rates:
            steps.next(f"{system}: {rate} msg/s for {seconds:g} s")
            try:
                run = run_one(system, rate, seconds)
            except Exception as exc:
                run = {"error": repr(exc)}
            problems += violations(system, rate, run)
            if "error" not in run:
                entry[str(rate)] = figures(run)
                lat = run["consumer"]["latency_ms"]
                note(f"  {system}: achieved {run['producer']['achieved_rate']:.0f}/s, "
                     f"p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms")
        results[system] = entry
    return results, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1000,10000", help="offered rates, msg/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each run")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--child", nargs=3, metavar=("ROLE", "SYSTEM", "SPEC"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(*a.child)
        return
    rates = [int(r) for r in a.rates.split(",") if r.strip()]
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not rates or min(rates) < 1 or a.seconds <= 0:
        ap.error(f"systems from {','.join(SYSTEMS)}, rates >= 1, seconds > 0")
    results, problems = run_all(systems, rates, a.seconds)
    if problems:
        raise AssertionError("exactly-once check failed, no figures reported:\n  "
                             + "\n  ".join(problems))
    report = {
        "workload": {"body_bytes": BODY, "rates": rates, "seconds": a.seconds,
                     "in_flight_max": IN_FLIGHT, "queues": 1,
                     "latency_from": "scheduled send time (coordinated omission included)",
                     "warmup": "first second or first 5% of each run, whichever is longer"},
        "results": results,
        "goals": goals(results),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
