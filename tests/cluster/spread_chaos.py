"""Chaos over a topic spread across two replicated broker groups (docs/cluster.md,
"Consumer groups across broker groups"). Shared by ``tests/cluster/test_spread_chaos.py``
and ``benchmarks/scale_out_chaos.py`` (longer, JSON).

Two groups of three brokers each, one etcd. Two topics of 8 queues, each spread over both
groups (queues 0, 2, 4, 6 on one, 1, 3, 5, 7 on the other):

* ``orders``: a producer sends ``order-N`` one after the other with unique keys to the
  cluster's bootstrap list; a reply is lost on purpose every ``LOST_EVERY`` sends (the
  send is made again with the same unique key, as a producer retry after a lost reply
  does) and a send that fails is sent again the same way. Consumed by push consumer
  processes with the idempotency layer (``tests/idem_consumer_proc.py``, a SQLite store,
  the business effect a row per message in a SQLite table, asked whether a key's effect
  happened when a SIGKILLed member's claim expired: ``reconcile``).
* ``ORD``: keyed messages ``<key> <seq>`` sent in per-queue batches (a key's messages on
  one queue, in order), consumed by orderly push consumer processes
  (``tests/orderly_proc.py``) that log every message handled with the machine's clock.

The storm: a consumer of each kind joins, one idempotent consumer is SIGKILLed, then the
leader of one broker group is SIGKILLed (and started again as a follower). Checked by the
caller: acknowledged sends lost, stored twice, effects not exactly once, orderly keys out
of order or missing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import OnceqError
from tests.cluster.group import Node, leader_of

TESTS = Path(__file__).resolve().parent.parent
TOPIC, ORD = "orders", "ORD"
QUEUES = 8
KEYS = 64
LOST_EVERY = 10


class Proc:
    """A consumer process; ``ready`` waits for its READY line."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.err = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                     stderr=self.err, env={**os.environ})

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        assert line.startswith(b"READY"), (line, self.err.name)

    async def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self.proc.wait, 60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _idem(bootstrap: str, work: Path, name: str) -> Proc:
    return Proc([str(TESTS / "idem_consumer_proc.py"), "--addr", bootstrap, "--group",
                 "billing", "--topic", TOPIC, "--store", f"sqlite:///{work / 'dedup.db'}",
                 "--effects", str(work / "effects.db"), "--commit-interval", "0.5",
                 # a claim of the member SIGKILLed mid-message blocks its key this long;
                 # then the effects table answers whether its effect happened (a kill
                 # between the effect and its CONSUMED record would repeat it otherwise)
                 "--lease", "5", "--reconcile",
                 "--pull-suspend", "1", "--rebalance-interval", "1"],
                work / f"{name}.log")


def _orderly(bootstrap: str, work: Path, name: str) -> Proc:
    return Proc([str(TESTS / "orderly_proc.py"), "--addr", bootstrap, "--group", "ordered",
                 "--topic", ORD, "--out", str(work / f"{name}.out"), "--client-id", name],
                work / f"{name}.log")


def _queue_of(n: int, message: Any) -> int:
    return zlib.crc32(message.body.split(b" ", 1)[0]) % n


async def _stored(bootstrap: str, topic: str) -> Counter[str]:
    """Every body stored in ``topic``, read from each queue's group."""
    out: Counter[str] = Counter()
    async with PullConsumer(bootstrap, "audit") as c:
        for q in range(QUEUES):
            offset = 0
            while (r := await c.pull(topic, q, offset, 256)).status == PullStatus.FOUND:
                out.update(m.body.decode() for m in r.messages)
                offset = r.next_offset
    return out


def _effects(work: Path) -> Counter[str]:
    path = work / "effects.db"
    if not path.exists():
        return Counter()
    conn = sqlite3.connect(path, timeout=30)
    try:
        return Counter(k for (k,) in conn.execute("SELECT key FROM effects"))
    finally:
        conn.close()


def orderly_check(work: Path, rounds: int) -> dict[str, Any]:
    """Per key, merged in time order over every member's log: each sequence number first
    handled after the one before it, none missing; a repeat only as a step back to
    handle again (a suffix redelivered after a kill)."""
    by_key: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for path in work.glob("*.out"):
        for line in path.read_bytes().splitlines():
            t, key, seq = line.split()
            by_key[key].append((int(t), int(seq)))
    problems, repeats = [], 0
    for key, rows in by_key.items():
        rows.sort()
        top = -1
        for _, seq in rows:
            if seq == top + 1:
                top = seq
            elif seq <= top:
                repeats += 1
            else:
                problems.append(f"{key.decode()}: {seq} after {top} (a gap or reorder)")
        if top != rounds - 1:
            problems.append(f"{key.decode()}: handled up to {top} of {rounds - 1}")
    missing = KEYS - len(by_key)
    return {"keys": len(by_key), "keys_missing": missing, "repeats": repeats,
            "problems": problems[:5], "problem_count": len(problems) + missing}


async def run(groups: dict[str, list[Node]], work: Path, *, phase_s: float = 2.0,
              rounds: int = 40, timeout_s: float = 60.0) -> dict[str, Any]:
    nodes = [n for ns in groups.values() for n in ns]
    bootstrap = ",".join(n.address for n in nodes)
    for ns in groups.values():
        await leader_of(ns, timeout=timeout_s, isr=len(ns))
    async with Admin(bootstrap) as admin:
        await admin.create_topic(TOPIC, QUEUES)
        await admin.create_topic(ORD, QUEUES)
    idem = {n: _idem(bootstrap, work, n) for n in ("i1", "i2")}
    ords = {n: _orderly(bootstrap, work, n) for n in ("o1", "o2")}
    await asyncio.gather(*(p.ready() for p in (*idem.values(), *ords.values())))
    acked: dict[str, float] = {}
    counts: Counter[str] = Counter()
    stop = asyncio.Event()

    async def produce() -> None:
        async with Producer(bootstrap, send_timeout=20.0) as p:
            i = 0
            while not stop.is_set():
                key = f"order-{i}"
                try:
                    await p.send(TOPIC, Message(key.encode(), unique_key=key))
                    if i % LOST_EVERY == 0:  # its reply lost: sent again
                        counts["lost_replies"] += 1
                        await p.send(TOPIC, Message(key.encode(), unique_key=key))
                except OnceqError:
                    counts["send_errors_retried"] += 1  # maybe stored: sent again
                    continue
                acked[key] = time.monotonic()
                i += 1
                await asyncio.sleep(0.002)

    async def produce_keyed() -> None:
        async with Producer(bootstrap, send_timeout=20.0) as p:
            for r in range(rounds):
                per_queue: dict[int, list[bytes]] = defaultdict(list)
                for k in range(KEYS):
                    body = b"k%03d %d" % (k, r)
                    per_queue[zlib.crc32(body.split(b" ")[0]) % QUEUES].append(body)
                for msgs in per_queue.values():
                    while True:  # a batch failed is sent again whole (in order)
                        try:
                            await p.send_batch(ORD, msgs, selector=_queue_of)
                            break
                        except OnceqError:
                            counts["keyed_batches_retried"] += 1
                await asyncio.sleep(phase_s * 4 / rounds)

    producers = [asyncio.create_task(produce()), asyncio.create_task(produce_keyed())]
    storm: dict[str, Any] = {}
    try:
        await asyncio.sleep(phase_s)
        idem["i3"] = _idem(bootstrap, work, "i3")  # members join
        ords["o3"] = _orderly(bootstrap, work, "o3")
        await asyncio.gather(idem["i3"].ready(), ords["o3"].ready())
        await asyncio.sleep(phase_s)
        idem.pop("i1").kill()  # a member SIGKILLed: no commit, no unregister
        storm["member_killed"] = "i1"
        await asyncio.sleep(phase_s)
        name = sorted(groups)[0]
        leader = await leader_of(groups[name], timeout=timeout_s, isr=len(groups[name]))
        t_kill = time.monotonic()
        leader.kill()  # one group's leader SIGKILLed, then back as a follower
        leader.start()
        storm["leader_killed"] = f"{name}/{leader.broker_id}"
        # sends go on: 20 acknowledged after the kill (about half to the group whose
        # leader died: a send's unique key picks its group)
        while sum(1 for t in list(acked.values())[-20:] if t > t_kill) < 20:
            if time.monotonic() - t_kill > timeout_s:
                raise AssertionError(f"sends stopped after the leader kill: {counts}")
            await asyncio.sleep(0.05)
        storm["sends_back_after_s"] = round(time.monotonic() - t_kill, 2)
        storm["acked_after_leader_kill"] = sum(1 for t in acked.values() if t > t_kill)
        await producers[1]
    finally:
        stop.set()
        await asyncio.gather(*producers, return_exceptions=True)
    deadline = time.monotonic() + timeout_s
    effects = _effects(work)
    while any(effects[k] == 0 for k in acked) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        effects = _effects(work)
    while orderly_check(work, rounds)["problem_count"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.gather(*(p.stop() for p in (*idem.values(), *ords.values())))
    stored = await _stored(bootstrap, TOPIC)
    effects = _effects(work)
    return {
        "groups": {g: len(ns) for g, ns in groups.items()},
        "acknowledged": len(acked),
        **counts,
        **storm,
        "lost": sorted(k for k in acked if stored[k] == 0),
        "stored_twice": sorted(k for k, n in stored.items() if n > 1),
        "effects_not_once": sorted(f"{k} x{effects[k]}" for k in acked if effects[k] != 1),
        "effects_unacknowledged": sorted(set(effects) - set(acked)),
        "orderly": orderly_check(work, rounds),
    }
