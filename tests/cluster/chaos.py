"""The leader of a 3-broker group SIGKILLed again and again under load, and what must
hold afterwards. Shared by ``tests/cluster/test_failover_chaos.py`` (3 kills) and
``benchmarks/cluster_failover.py`` (20 kills, JSON).

A producer sends ``order-N`` messages one after the other to the group's bootstrap list
(acks=all); a send that fails is sent again with the same unique key until it is
acknowledged. A push consumer group member with the idempotency layer (a SQLite store)
counts each message's business effect inside its listener. After each kill the killed
broker is started again, and the next kill waits until it is back in the ISR.

What is recorded (inside the listener and the producer), and checked by the caller:

* ``failover_s``: per kill, the time from the kill to the first send acknowledged after it;
* ``lost``: acknowledged keys that are not in the leader's log at the end;
* ``stored_twice``: keys stored more than once;
* ``effects_not_once``: acknowledged keys whose effect did not happen exactly once;
* ``replicas_equal``: every broker's log equal to the leader's up to the high watermark.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.push import PushConsumer
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import OnceqError
from tests.cluster.group import Node, leader_of, status

TOPIC = "orders"
QUEUES = 4


class Effects:
    """The business side: one count per effect, recorded inside the listener."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, msgs: list[Any], ctx: Any) -> None:
        with self._lock:
            for m in msgs:
                self.count[m.body.decode()] += 1


async def _in_sync(nodes: list[Node], n: int, timeout: float) -> Node:
    return await leader_of(nodes, timeout=timeout, isr=n)


async def _stored(address: str) -> Counter[str]:
    """Every body stored in the topic (read from the leader, every queue)."""
    out: Counter[str] = Counter()
    async with PullConsumer(address, "audit") as c:
        for q in range(QUEUES):
            offset = 0
            while True:
                r = await c.pull(TOPIC, q, offset, 256)
                if r.status != PullStatus.FOUND:
                    break
                out.update(m.body.decode() for m in r.messages)
                offset = r.next_offset
    return out


async def run(nodes: list[Node], kills: int, work: Path, *, settle_s: float = 1.0,
              timeout_s: float = 30.0) -> dict[str, Any]:
    bootstrap = ",".join(n.address for n in nodes)
    await _in_sync(nodes, len(nodes), timeout_s)
    async with Admin(bootstrap) as admin:
        await admin.create_topic(TOPIC, QUEUES)
    effects = Effects()
    consumer = PushConsumer(bootstrap, "billing", effects, consume_from="FIRST",
                            idempotency=f"sqlite:///{work / 'dedup.db'}",
                            pull_suspend_s=1.0, commit_interval_s=0.5,
                            heartbeat_interval_s=1.0, rebalance_interval_s=2.0)
    consumer.subscribe(TOPIC)
    await consumer.start()
    acked: dict[str, tuple[float, float]] = {}  # key -> (sent, acknowledged), monotonic
    send_errors = 0
    stop = asyncio.Event()

    async def produce() -> None:
        nonlocal send_errors
        async with Producer(bootstrap, send_timeout=20.0) as p:
            i = 0
            while not stop.is_set():
                key = f"order-{i}"
                sent = time.monotonic()
                try:
                    await p.send(TOPIC, Message(key.encode(), unique_key=key))
                except OnceqError:
                    send_errors += 1  # maybe stored: sent again with the same key
                    continue
                acked[key] = (sent, time.monotonic())
                i += 1

    producer = asyncio.create_task(produce())
    failover: list[float] = []
    try:
        for _ in range(kills):
            leader = await _in_sync(nodes, len(nodes), timeout_s)
            before = len(acked)
            deadline = time.monotonic() + timeout_s
            while len(acked) < before + 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # under load: some sends since the last kill
            t_kill = time.monotonic()
            leader.kill()
            leader.start()  # back as a follower: it cuts its divergent tail and catches up
            # sends succeed again: one sent after the kill is acknowledged (a reply read
            # after the kill may have left the killed leader before it)
            while not any(s > t_kill for s, _ in list(acked.values())[-3:]):
                if time.monotonic() - t_kill > timeout_s:
                    raise AssertionError(f"no send acknowledged {timeout_s}s after a kill")
                await asyncio.sleep(0.01)
            first = min(a for s, a in list(acked.values())[-50:] if s > t_kill)
            failover.append(first - t_kill)
        await asyncio.sleep(settle_s)
    finally:
        stop.set()
        await asyncio.gather(producer, return_exceptions=True)
    # the consumer drains everything acknowledged
    deadline = time.monotonic() + timeout_s
    while any(effects.count[k] == 0 for k in acked) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await consumer.shutdown()
    leader = await _in_sync(nodes, len(nodes), timeout_s)
    stored = await _stored(leader.address)
    equal, hw = await _replicas_equal(nodes, leader, timeout_s)
    return {
        "kills": kills,
        "acknowledged": len(acked),
        "send_errors_retried": send_errors,
        "failover_s": [round(x, 3) for x in failover],
        "failover_p50_s": round(statistics.median(failover), 3) if failover else None,
        "failover_max_s": round(max(failover), 3) if failover else None,
        "lost": sorted(k for k in acked if stored[k] == 0),
        "stored_twice": sorted(k for k, n in stored.items() if n > 1),
        "effects_not_once": sorted(k for k in acked if effects.count[k] != 1),
        "effects_unacknowledged": sorted(set(effects.count) - set(acked)),
        "replicas_equal": equal,
        "compared_bytes": hw,
    }


async def _replicas_equal(nodes: list[Node], leader: Node, timeout_s: float
                          ) -> tuple[bool, int]:
    """Every broker's log equal to the leader's up to the high watermark, once every
    follower has fetched up to it."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = await status(leader)
        if st is not None and st.get("hw") == st.get("log_end"):
            hw = int(st["hw"])
            logs = [n.log_bytes(hw) for n in nodes]
            if all(len(b) == len(logs[0]) for b in logs):
                return all(b == logs[0] for b in logs), hw
        if time.monotonic() > deadline:
            return False, -1
        await asyncio.sleep(0.1)
