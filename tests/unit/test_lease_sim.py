"""A member that lost a queue's lock while it was away, in virtual time: real push
consumers against the in-memory broker that runs the broker's ownership core.

The broker frees the member's locks (its heartbeat expired, as after a long pause) and
another member takes one of its queues; the member learns it from its next heartbeat
answer (or a refused pull, or a commit behind the group's), drops that queue's process
queue without committing, and consumes nothing of it any more.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from onceq.client.push import PushConsumer
from tests.clock import FakeClock
from tests.sim import FakeBroker, run_virtual

GROUP = "g"


def test_a_member_whose_lock_went_elsewhere_drops_the_queue_and_moves_no_offset_back():
    async def main(clock: FakeClock):
        broker = FakeBroker(clock)
        broker.create_topic("T", 2)
        delivered: list[tuple[int, int, float]] = []  # queue, offset, time: asserted below
        release = asyncio.Event()

        async def listener(msgs, ctx):
            for m in msgs:
                delivered.append((ctx.queue.queue_id, m.queue_offset, clock()))
            if ctx.queue.queue_id == 0 and msgs[0].queue_offset >= 5:
                await release.wait()  # a long call on queue 0: messages pile up behind it

        a = PushConsumer("fake:9876", GROUP, listener, client_id="a", clock=clock,
                         connect=broker.connect, consume_from="FIRST", concurrency=1,
                         heartbeat_interval_s=3.0, rebalance_interval_s=3600.0)
        a.subscribe("T")
        await a.start()
        broker.put("T", 0, 40)
        broker.put("T", 1, 5)
        while len([d for d in delivered if d[0] == 0]) < 6:
            await asyncio.sleep(0.5)
        offsets = [broker.offsets.get((GROUP, "T", 0), -1)]
        # while a is stuck: its locks are freed (as when its heartbeat expired during a
        # pause) and another client takes queue 0 and consumes it to the end
        broker.core.access.release_client("a")
        d = broker.core.pull(GROUP, "b", "T", 0, 0, locked=True, ack=offsets[0],
                             now=clock())
        assert d.refused is None and d.lock is not None
        broker.offsets[(GROUP, "T", 0)] = 40
        lost_at = clock()
        await asyncio.sleep(10.0)  # heartbeats answer that a holds queue 0 no more
        offsets.append(broker.offsets[(GROUP, "T", 0)])
        release.set()  # the long call ends; what a cached of queue 0 must not be handed on
        await asyncio.sleep(10.0)
        offsets.append(broker.offsets[(GROUP, "T", 0)])
        stats = Counter(a.stats)
        await a.shutdown()
        return delivered, offsets, stats, lost_at

    delivered, offsets, stats, lost_at = run_virtual(main)
    assert stats["queues_lost"] >= 1
    after = [(q, off) for q, off, t in delivered if q == 0 and t > lost_at]
    assert after == [], after  # nothing of queue 0 reached the listener again
    assert offsets[1:] == [40, 40]  # the group's offset stayed where the other left it
