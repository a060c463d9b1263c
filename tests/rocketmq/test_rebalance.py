"""Official PushConsumers joining and leaving a group under load: ``QueryAssignment`` gives
each member its share of the queues by onceq's allocation, and its receives go through
onceq's access lock, so a queue goes to its new member only once the previous one
released it. Every message is consumed; duplicates are counted with the lock and, on a
broker started with ``--no-access-lock``, without it."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from onceq import Admin, Producer

from .conftest import RmqBroker, rmq_broker

TOPIC, GROUP, QUEUES = "rmq-storm", "rmq-storm-g", 8
BURST = 300  # messages waiting when the first members start: a backlog in their caches
RATE, SECONDS = 60, 6.0  # then messages a second, for this long
HANDLER_MS, THREADS = 25, 2  # each message takes this long, a member runs 2 at a time


def _produce(addr: str, sent: list[str], done: threading.Event) -> None:
    async def run() -> None:
        async with Producer(addr) as p:
            for q in range(QUEUES):
                bodies = [f"m-{i}" for i in range(q, BURST, QUEUES)]
                await p.send_batch(TOPIC, [x.encode() for x in bodies], queue=q)
                sent.extend(bodies)
            done.set()  # the backlog is there
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < SECONDS:
                body = f"m-{BURST + i}"
                await p.send(TOPIC, body.encode())
                sent.append(body)
                i += 1
                ahead = i / RATE - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)

    try:
        asyncio.run(run())
    finally:
        done.set()


async def _create_topic(addr: str) -> None:
    async with Admin(addr) as a:
        await a.create_topic(TOPIC, QUEUES)


def _member(b: RmqBroker, out: Path) -> subprocess.Popen[str]:
    p = b.start("push_live", topic=TOPIC, group=GROUP, out=str(out), handler_ms=HANDLER_MS,
                threads=THREADS)
    assert p.stdout is not None
    line = p.stdout.readline()  # "ready": started, settings answered
    assert line.strip() == "ready", p.stderr.read() if p.stderr else line
    return p


def _stop(b: RmqBroker, p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdin is not None
    p.stdin.write("stop\n")
    p.stdin.flush()
    return b.result(p, 30)


def _consumed(files: list[Path]) -> list[str]:
    return [line.split()[0] for f in files if f.exists()
            for line in f.read_text().splitlines() if line.strip()]


def storm(b: RmqBroker, root: Path) -> dict[str, int]:
    """c1 and c2 consume; c3 joins under load, c1 leaves (gracefully) under load; the
    rest run until everything produced was consumed. Returns the counts."""
    files = [root / f"c{i}.log" for i in range(1, 4)]
    asyncio.run(_create_topic(b.addr))
    sent: list[str] = []
    produced = threading.Event()
    producer = threading.Thread(target=_produce, args=(b.addr, sent, produced))
    producer.start()
    produced.wait(30)
    c1, c2 = _member(b, files[0]), _member(b, files[1])
    time.sleep(1.5)
    c3 = _member(b, files[2])  # joins: queues move from c1 and c2 to it
    time.sleep(1.5)
    _stop(b, c1)  # leaves: its queues move to c2 and c3
    producer.join()
    deadline = time.monotonic() + 30
    while set(_consumed(files)) < set(sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in (c2, c3):
        _stop(b, p)
    consumed = _consumed(files)
    counts = collections.Counter(consumed)
    return {"produced": len(sent), "consumed": len(consumed),
            "lost": len(set(sent) - set(consumed)),
            "duplicates": sum(n - 1 for n in counts.values())}


def test_push_consumers_joining_and_leaving_consume_everything_once(
        rmq: RmqBroker, tmp_path: Path) -> None:
    with_lock = storm(rmq, tmp_path)
    with rmq_broker(tmp_path / "nolock", "--no-access-lock") as b:
        without = storm(b, tmp_path / "nolock")
    print(f"rebalance duplicates: with the access lock {with_lock}, without {without}")
    assert with_lock["lost"] == 0 and without["lost"] == 0
    assert with_lock["produced"] >= BURST + RATE * SECONDS * 0.8
    # the access lock: no message consumed twice across the handovers
    assert with_lock["duplicates"] == 0
