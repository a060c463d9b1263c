"""Moving queues whose head went to retention (docs/cluster.md, "Moving a queue to
another group"): on the new group a queue starts at the first offset its old group still
holds, with the same messages at the same offsets, and a queue with no message left
starts at its next offset; the group's follower takes the restart from the log (it
serves the same offsets after its leader is SIGKILLed); a producer retry of a copied
message is a duplicate on the new group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from onceq.client.admin import Admin
from onceq.client.connection import BrokerConnection, call
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.reassign import reassign
from onceq.protocol.codes import PullStatus
from onceq.protocol.replies import QueueStateReply
from onceq.protocol.requests import QueueState
from tests.cluster.group import leader_of, make_group
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)
TOPIC = "old"
BODY = b"r" * 4000
SMALL_LOG = ["--min-insync", "1", "--segment-size", "65536", "--max-body", "8192",
             "--retention-bytes", "65536", "--retention-check", "0.2"]


async def _state(address: str, queue: int) -> tuple[int, int, dict[str, Any]]:
    conn = await BrokerConnection.open(address)
    try:
        s: QueueStateReply = await call(conn, QueueState(TOPIC, queue), 5.0)
        return s.min, s.max, dict(s.offsets)
    finally:
        conn.close()


async def _read(address: str, queue: int, offset: int) -> list[tuple[int, bytes]]:
    """(offset, body) of ``queue`` from ``offset`` on, read from the broker at
    ``address`` whatever the route says."""
    out: list[tuple[int, bytes]] = []
    async with PullConsumer(address, "audit") as c:
        while (r := await c.pull(TOPIC, queue, offset, 64)).status == PullStatus.FOUND:
            out += [(m.queue_offset, m.body) for m in r.messages]
            offset = r.next_offset
    return out


async def _past(address: str) -> bool:
    """Retention removed the head of queue 0 and every message of queue 1."""
    (lo0, hi0, _), (lo1, hi1, _) = await _state(address, 0), await _state(address, 1)
    return 0 < lo0 < hi0 == 60 and lo1 == hi1 == 10


def test_queues_past_retention_move_with_their_offsets(tmp_path: Path, etcd_endpoint: str,
                                                       cluster_name: str) -> None:
    g1 = make_group(tmp_path / "g1", etcd_endpoint, cluster_name, 1, *SMALL_LOG, group="g1")
    g2 = make_group(tmp_path / "g2", etcd_endpoint, cluster_name, 2, group="g2")
    source = g1[0].address

    async def go() -> dict[str, Any]:
        await leader_of(g1, timeout=20)
        await leader_of(g2, timeout=20, isr=2)
        bootstrap = ",".join(n.address for n in (*g1, *g2))
        async with Admin(bootstrap) as admin:
            await admin.create_topic(TOPIC, 2, placement=["g1", "g1"])
        async with Producer(bootstrap) as p:
            await p.send_batch(TOPIC, [BODY.replace(b"r", b"q")] * 10, queue=1)
            for i in range(6):
                last = await p.send_batch(TOPIC, [BODY[:-2] + b"%02d" % (i * 10 + j)
                                                  for j in range(10)], queue=0)
        # retention removes the head of queue 0 and all of queue 1 on g1
        await wait_until(lambda: _past(source), 20, "retention on g1")
        lo, hi, _ = await _state(source, 0)
        before = await _read(source, 0, lo)
        async with PullConsumer(source, "billing") as c:
            await c.commit_offset(TOPIC, 0, lo + 3)
        moves = [await reassign(etcd_endpoint, cluster_name, TOPIC, q, "g2",
                                drain_timeout=0.5) for q in (0, 1)]
        leader = await leader_of(g2, timeout=10, isr=2)
        on_g2 = {q: await _state(leader.address, q) for q in (0, 1)}
        async with Producer(bootstrap) as p:  # the route says g2 now
            sent = [(await p.send(TOPIC, b"after", queue=q)).offset for q in (0, 1)]
            # a producer retry of a message sent before the move: a duplicate on g2 too
            retried = await p.send(TOPIC, Message(BODY[:-2] + b"59",
                                                  unique_key=last[-1].unique_key), queue=0)
        copied = await _read(leader.address, 0, lo)
        leader.kill()  # its follower takes over with the restart it took from the log
        new = await leader_of([n for n in g2 if n is not leader], timeout=20)
        return {"lo": lo, "hi": hi, "before": before, "moves": moves, "on_g2": on_g2,
                "sent": sent, "retried": (retried.duplicate, retried.offset,
                                          last[-1].offset),
                "copied": copied, "after_kill": {
                    q: await _state(new.address, q) for q in (0, 1)},
                "read_after_kill": await _read(new.address, 0, lo)}

    try:
        out = asyncio.run(go())
    finally:
        for n in (*g1, *g2):
            n.kill()
    lo, hi = out["lo"], out["hi"]
    m0, m1 = out["moves"]
    assert m0["moved"] and m0["end"] == hi == 60 and m0["copied"] == hi - lo, m0
    assert m1["moved"] and m1["end"] == 10 and m1["copied"] == 0, m1
    # queue 0 on g2: the same messages at the same offsets, the consumer group's offset
    assert out["before"] == out["copied"][:hi - lo]
    assert [o for o, _ in out["before"]] == list(range(lo, hi))
    assert out["on_g2"][0][:2] == (lo, hi) and out["on_g2"][0][2]["billing"] == lo + 3
    # queue 1 held nothing: it goes on at its next offset
    assert out["on_g2"][1][:2] == (10, 10)
    assert out["sent"] == [hi, 10]
    assert out["retried"] == (True, hi - 1, hi - 1)  # the copy's key known to g2's window
    # the follower serves the same offsets after its leader's SIGKILL
    assert out["after_kill"][0][:2] == (lo, hi + 1) and out["after_kill"][1][:2] == (10, 11)
    assert out["read_after_kill"] == out["copied"]
    print("reassign past retention:", {"queue_0": [lo, hi], "copied": m0["copied"],
                                       "seconds": [m0["seconds"], m1["seconds"]]})
