"""Orderly push consumers simulated in virtual time: real consumers (rebalance, orderly
consume service, lock renewal) against the in-memory broker with the real queue-lock table.

Random membership histories (joins and graceful leaves at random times) while messages
flow: every queue's messages are handled in offset order, each exactly once, never by two
members at once, and at the end each queue's lock is held by its owner.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.clock import FakeClock
from tests.sim import FakeBroker, run_virtual
from tests.unit.test_rebalance_sim import GROUP, N_QUEUES, SimGroup, _run_script, scripts


def _orderly_outcome(group: SimGroup, keys: list[str]) -> None:
    assert set(group.keys) == set(keys), "messages lost"
    assert group.overlaps == [], "a queue was consumed by two members at once"
    dups = {k: n for k, n in group.keys.items() if n > 1}
    assert dups == {}, f"{len(dups)} messages handled more than once"
    per_queue: dict[int, list[int]] = defaultdict(list)
    for mq, offset, _name in group.deliveries:
        if mq.topic == "T":
            per_queue[mq.queue_id].append(offset)
    for q, offsets in per_queue.items():
        assert offsets == list(range(len(offsets))), f"queue {q} out of order: {offsets}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), handler_s=st.sampled_from([0.0, 0.3, 4.0]),
       latency=st.sampled_from([0.0005, 0.01, 0.2]))
def test_random_membership_keeps_every_queue_in_order_once(script, handler_s, latency):
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, latency=latency, access_lock=False)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, handler_s=handler_s, orderly=True)
        keys = await _run_script(group, script)  # checks the stable assignment
        return group, keys

    group, keys = run_virtual(main)
    _orderly_outcome(group, keys)


def test_locks_follow_the_owners_and_expire_with_a_hung_member():
    """Steady state: each queue's orderly lock is held by its owner, renewed every 20 s
    (so it never reaches the 60 s expiry)."""
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, latency=0.001, access_lock=False)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, handler_s=0.01, orderly=True)
        await group.join("a")
        await group.join("b")
        await asyncio.sleep(200.0)  # ten renewals
        owners = {mq: cid for cid, c in group.members.items() for mq in c.assignment}
        holders = {mq: broker.qlocks.holder(GROUP, mq.topic, mq.queue_id, clock())
                   for mq in owners}
        renewals = sum(1 for _c, code, _h in broker.requests if code.name == "LOCK_QUEUES")
        await group.shutdown()
        left = broker.qlocks.snapshot(GROUP, clock())
        return owners, holders, renewals, left

    owners, holders, renewals, left = run_virtual(main)
    assert holders == owners and len(owners) == N_QUEUES + 1
    assert renewals >= 2 * 10  # two members, every 20 s
    assert left == []  # the graceful leaves unlocked everything


def test_a_long_run_yields_and_goes_on_in_order():
    """A queue with a backlog consumed continuously yields after ``orderly_yield_s`` and
    its next run goes on where it stopped."""
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, latency=0.001, access_lock=False)
        broker.create_topic("T", 1)
        keys = broker.put("T", 0, 40)
        group = SimGroup(broker, clock, handler_s=0.5, orderly=True, orderly_yield_s=2.0)
        c = await group.join("a")
        while len(group.keys) < len(keys):
            await asyncio.sleep(1.0)
        await group.shutdown()
        return group, keys, c.stats["yielded"]

    group, keys, yielded = run_virtual(main)
    assert yielded >= 5  # 40 x 0.5 s in runs of about 2 s
    _orderly_outcome(group, keys)


def test_a_batch_running_past_the_drain_timeout_keeps_its_lock_until_it_ends():
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, latency=0.001, access_lock=False)
        broker.create_topic("T", 2)
        keys = broker.put("T", 0, 3) + broker.put("T", 1, 3)
        group = SimGroup(broker, clock, handler_s=15.0, orderly=True, drain_timeout_s=2.0)
        await group.join("a")
        await asyncio.sleep(1.0)  # a runs its first batches (15 s each)
        await group.join("b")  # b is assigned queue 1; a's batch there is still running
        while len(group.keys) < len(keys):
            await asyncio.sleep(1.0)
        await asyncio.sleep(30.0)
        refused = group.members["b"].stats["lock_refused"]
        await group.shutdown()
        return group, keys, refused

    group, keys, refused = run_virtual(main)
    assert refused >= 1  # b waited for a's batch to end before it got the lock
    _orderly_outcome(group, keys)
    assert {name for mq, _o, name in group.deliveries if mq.queue_id == 1} == {"a", "b"}
