"""Isolation of an unhealthy queue: the broker's writes to one queue fail (a fault injected
in its send path); the producer moves unkeyed sends away from it for a back-off, so its
success rate recovers at once, and no send is lost or stored twice."""

from __future__ import annotations

import time

import pytest

from onceq.client.admin import Admin
from onceq.client.message import Message
from onceq.client.producer import Producer
from onceq.client.pull import PullConsumer
from onceq.client.queue_health import BACKOFF_S
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.protocol.requests import Send
from tests.helpers import running_broker

pytestmark = pytest.mark.timeout(60)
QUEUES, BROKEN = 4, 2


async def test_a_failing_queue_is_avoided_and_nothing_is_lost(tmp_path) -> None:
    async with running_broker(str(tmp_path / "data")) as b:
        attempts: list[tuple[float, int]] = []  # (when, queue) of every send the broker saw
        request_type, h_send = b.handlers[Send.CODE]

        def faulty(call, req):
            attempts.append((time.monotonic(), req.queue))
            if req.queue == BROKEN:
                raise OnceqError(ErrorCode.STORAGE_ERROR, "injected: the queue's write failed")
            return h_send(call, req)

        b.handlers[Send.CODE] = (request_type, faulty)
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin, Producer(addr, send_timeout=5.0) as p:
            await admin.create_topic("orders", QUEUES)
            start = time.monotonic()
            results = []
            while time.monotonic() - start < 2.5 * BACKOFF_S:  # past two back-offs
                i = len(results)  # unkeyed: round-robin over the healthy queues
                results.append(await p.send("orders", Message(f"m{i}".encode(),
                                                              unique_key=f"m{i}")))
            took = time.monotonic() - start
        n = len(results)
        broken = [t for t, q in attempts if q == BROKEN]
        # every send acknowledged; the broken queue tried again after each back-off (1 s,
        # then 2 s): once per window, no more
        assert all(r.queue_id != BROKEN for r in results)
        windows = 1
        t, backoff = broken[0], BACKOFF_S
        while t + backoff < start + took:
            t, backoff, windows = t + backoff, backoff * 2, windows + 1
        assert 2 <= len(broken) <= windows, (len(broken), took)
        assert p.health.avoided >= n // QUEUES - len(broken)
        async with PullConsumer(addr, "check") as c:
            bodies = []
            for q in range(QUEUES):
                offset = 0
                while (r := await c.pull("orders", q, offset, 1000)).status == \
                        PullStatus.FOUND:
                    bodies += [m.body.decode() for m in r.messages]
                    offset = r.next_offset
        assert sorted(bodies) == sorted(f"m{i}" for i in range(n))
        print({"sends": n, "seconds": round(took, 2), "broken_queue_attempts": len(broken),
               "avoided": p.health.avoided})
