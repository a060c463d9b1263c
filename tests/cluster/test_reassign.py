"""A queue moved to another broker group under load (``onceq topic reassign``,
docs/cluster.md "Moving a queue to another group"): producers keep sending (keyed sends
to the moving queue wait, unkeyed ones go elsewhere), push consumers keep consuming, and
the queue's offsets, as the consumers see them, go on without a gap or a repeat on its
new group; every acknowledged message is stored once, each key in order."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from onceq.client.admin import Admin
from onceq.client.connection import BrokerConnection, call
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.push import PushConsumer
from onceq.client.reassign import reassign
from onceq.cluster import EtcdClient, read_route
from onceq.protocol.codes import PullStatus
from onceq.protocol.replies import QueueStateReply
from onceq.protocol.requests import QueueState
from tests.cluster.group import Node, leader_of, make_group
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(150)
TOPIC = "orders"
QUEUES = 4
KEYS = [f"k{i}" for i in range(16)]


class Seen:
    """Deliveries (queue, offset, body), recorded inside the listener."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, str]] = []
        self._lock = threading.Lock()

    def __call__(self, msgs: list[Any], ctx: Any) -> None:
        with self._lock:
            self.rows += [(m.queue_id, m.queue_offset, m.body.decode()) for m in msgs]


async def _stored(address: str, queue: int) -> list[str]:
    """The bodies of ``queue`` in offset order, read from the broker at ``address``."""
    out: list[str] = []
    async with PullConsumer(address, "audit") as c:
        offset = 0
        while (r := await c.pull(TOPIC, queue, offset, 256)).status == PullStatus.FOUND:
            out += [m.body.decode() for m in r.messages]
            offset = r.next_offset
    return out


async def _end(address: str, queue: int) -> int:
    """Where ``queue`` ends in the store of the broker at ``address``, whatever the route."""
    conn = await BrokerConnection.open(address)
    try:
        state: QueueStateReply = await call(conn, QueueState(TOPIC, queue), 5.0)
        return state.max
    finally:
        conn.close()


def test_a_queue_moves_to_another_group_under_load(tmp_path: Path, etcd_endpoint: str,
                                                   cluster_name: str) -> None:
    groups = {g: make_group(tmp_path / g, etcd_endpoint, cluster_name, 1, "--min-insync",
                            "1", group=g) for g in ("g1", "g2")}
    nodes: list[Node] = [n for ns in groups.values() for n in ns]
    g1, g2 = groups["g1"][0].address, groups["g2"][0].address

    async def go() -> dict[str, Any]:
        for ns in groups.values():
            await leader_of(ns, timeout=20)
        bootstrap = ",".join(n.address for n in nodes)
        async with Admin(bootstrap) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        etcd = EtcdClient(etcd_endpoint)
        route = await read_route(etcd, cluster_name, TOPIC)
        assert route is not None and route.placement[0] == "g1"
        seen = Seen()
        consumers = [PushConsumer(addr, "billing", seen, client_id=name,
                                  consume_from="FIRST", rebalance_interval_s=1.0,
                                  heartbeat_interval_s=1.0, commit_interval_s=0.2,
                                  pull_suspend_s=0.5)
                     for name, addr in (("a", g1), ("b", g2))]
        for c in consumers:
            c.subscribe(TOPIC)
            await c.start()
        acked: list[str] = []
        waits: list[float] = []
        stop = asyncio.Event()

        async def produce() -> None:
            loop = asyncio.get_running_loop()
            async with Producer(bootstrap, send_timeout=30.0) as p:
                seq = 0
                while not stop.is_set():
                    key = KEYS[seq % len(KEYS)]
                    body = f"{key} {seq}"
                    t = loop.time()
                    await p.send(TOPIC, Message(body.encode()), sharding_key=key)
                    waits.append(loop.time() - t)
                    acked.append(body)
                    await p.send(TOPIC, Message(f"u {seq}".encode()))
                    acked.append(f"u {seq}")
                    seq += 1
                    await asyncio.sleep(0.002)

        producer = asyncio.create_task(produce())
        try:
            await wait_until(lambda: len(acked) > 300, 20, "sends before the move")
            moved = await reassign(etcd_endpoint, cluster_name, TOPIC, 0, "g2",
                                   drain_timeout=20)
            after = len(acked)
            await wait_until(lambda: len(acked) > after + 300, 30, "sends after the move")
        finally:
            stop.set()
            await producer
        try:
            await wait_until(lambda: len({(q, o) for q, o, _ in seen.rows}) >= len(acked),
                             30, "every message consumed")
        except AssertionError:
            got = Counter(q for q, _ in {(q, o) for q, o, _ in seen.rows})
            ends = {q: len(await _stored(bootstrap, q)) for q in range(QUEUES)}
            raise AssertionError(f"consumed per queue {dict(got)}, stored {ends}, "
                                 f"move {moved}, owned "
                                 f"{[(c.client_id, c.assignment) for c in consumers]}"
                                 ) from None
        for c in consumers:
            await c.shutdown()
        return {"moved": moved, "acked": acked, "rows": seen.rows,
                "longest_keyed_send_s": max(waits),
                "g1_q0_end": await _end(g1, 0), "g2_q0": await _stored(g2, 0),
                "all": [b for q in range(QUEUES) for b in await _stored(bootstrap, q)],
                "route": await read_route(etcd, cluster_name, TOPIC)}

    try:
        out = asyncio.run(go())
    finally:
        for n in nodes:
            n.kill()
    moved, rows = out["moved"], out["rows"]
    assert moved["moved"] and moved["from"] == "g1" and moved["drained"], moved
    assert out["route"].placement[0] == "g2" and not out["route"].moving
    # g1 stored nothing in queue 0 after it was sealed; g2 holds its copy, then more
    end = moved["end"]
    assert out["g1_q0_end"] == end and len(out["g2_q0"]) > end
    # as the consumers saw queue 0: every offset once, none missing, the body stored there
    q0 = sorted((o, b) for q, o, b in rows if q == 0)
    assert [o for o, _ in q0] == list(range(len(out["g2_q0"]))), "a gap or a repeat"
    assert [b for _, b in q0] == out["g2_q0"]
    # nothing lost, nothing stored twice, each key in order (on its queue)
    assert sorted(out["all"]) == sorted(out["acked"])
    assert not [b for b, n in Counter(b for _, _, b in rows).items() if n > 1]
    by_key: dict[str, list[int]] = defaultdict(list)
    for _, _, body in sorted(rows, key=lambda r: (r[0], r[1])):
        key, seq = body.split()
        by_key[key].append(int(seq))
    assert all(s == sorted(s) for k, s in by_key.items() if k != "u")
    print("reassign:", json.dumps({**moved, "offsets": None,
                                   "longest_keyed_send_s": round(out["longest_keyed_send_s"],
                                                                 3)}))


def test_reassign_cli_refuses_clearly(etcd_endpoint: str, cluster_name: str) -> None:
    """Unknown topic: a clear error and exit code 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "onceq.cli.main", "topic", "reassign",
                        "nosuch", "0", "--to", "g9", "--cluster", etcd_endpoint,
                        "--cluster-name", cluster_name], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "TOPIC_NOT_EXIST" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
