"""Rebalance timing and planning, and a consumer group simulated in virtual time.

No sockets and no real sleeps: the pure parts take a fake clock; the group simulation runs
real push consumers against an in-memory broker on an event loop whose time is that clock.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.client.allocation import MessageQueue, allocate_average
from onceq.client.process_queue import ProcessQueue
from onceq.client.push import PushConsumer
from onceq.client.rebalance import RebalanceTimer, plan_rebalance
from onceq.protocol.codes import RequestCode
from tests.clock import FakeClock
from tests.handover import moved
from tests.sim import FakeBroker, run_virtual

QUEUES = [MessageQueue("T", i) for i in range(16)] + [MessageQueue("%RETRY%g", 0)]


# ================================================================ RebalanceTimer
def test_timer_first_check_is_due_at_once_then_every_interval():
    clock = FakeClock()
    timer = RebalanceTimer(20.0, clock())
    assert timer.due(clock()) and timer.wait_time(clock()) == 0.0
    timer.done(clock())
    assert not timer.due(clock())
    assert timer.wait_time(clock()) == 20.0
    clock.advance(19.9)
    assert not timer.due(clock())
    assert timer.wait_time(clock()) == pytest.approx(0.1)
    clock.advance(0.1)
    assert timer.due(clock()) and timer.wait_time(clock()) == 0.0
    timer.done(clock())
    clock.advance(5)
    assert not timer.due(clock()) and timer.wait_time(clock()) == pytest.approx(15.0)


def test_timer_is_due_immediately_after_notify():
    clock = FakeClock()
    timer = RebalanceTimer(20.0, clock())
    timer.done(clock())
    clock.advance(1.0)
    timer.notify()
    assert timer.due(clock()) and timer.wait_time(clock()) == 0.0
    timer.done(clock())  # the notified rebalance ran: back to the interval
    assert not timer.due(clock()) and timer.wait_time(clock()) == 20.0
    # a notification arriving while a rebalance runs (after done()) is not lost
    timer.notify()
    assert timer.due(clock())


def test_timer_ticks_over_a_long_run():
    clock = FakeClock(0.0)
    timer = RebalanceTimer(20.0, clock())
    runs = []
    for _ in range(400):  # 100 s in steps of 0.25 s (exact in binary floating point)
        if timer.due(clock()):
            timer.done(clock())
            runs.append(clock())
        clock.advance(0.25)
    assert runs == [0.0, 20.0, 40.0, 60.0, 80.0]


@given(last=st.floats(0, 1e6), interval=st.floats(0.001, 1e4),
       step=st.sampled_from([-1e-9, -1e-13, 0.0, 1e-13, 1e-9]))
def test_timer_is_due_exactly_when_there_is_nothing_left_to_wait(last, interval, step):
    """Around the deadline, by a rounding step: a waiter told to wait more must not find the
    timer due, nor find it not due after waiting 0 (the rebalance loop would spin)."""
    timer = RebalanceTimer(interval, 0.0)
    timer.done(last)
    now = last + interval + step
    assert timer.due(now) == (timer.wait_time(now) == 0.0)


# ================================================================ plan_rebalance
def q(*ids: int) -> list[MessageQueue]:
    return [MessageQueue("T", i) for i in ids]


def test_plan_revokes_and_assigns():
    plan = plan_rebalance(owned=q(0, 1, 2, 3), desired=q(2, 3, 4, 5))
    assert plan.revoke == q(0, 1)
    assert plan.assign == q(4, 5)


def test_plan_no_change():
    plan = plan_rebalance(owned=q(3, 1), desired=q(1, 3))
    assert plan.revoke == [] and plan.assign == []


def test_plan_from_nothing_and_to_nothing():
    assert plan_rebalance([], q(1, 0)).assign == q(0, 1)
    assert plan_rebalance(q(1, 0), []).revoke == q(0, 1)


def test_plan_stalled_queue_is_dropped_and_taken_again():
    plan = plan_rebalance(owned=q(0, 1, 2), desired=q(0, 1, 2), stalled=q(1))
    assert plan.revoke == q(1) and plan.assign == q(1)


def test_plan_stalled_queue_no_longer_desired_is_only_dropped():
    plan = plan_rebalance(owned=q(0, 1), desired=q(0), stalled=q(1))
    assert plan.revoke == q(1) and plan.assign == []


def test_plan_stalled_queue_not_owned_is_ignored():
    plan = plan_rebalance(owned=q(0), desired=q(0, 1), stalled=q(1, 7))
    assert plan.revoke == [] and plan.assign == q(1)


def test_stalled_detection_after_120s_feeds_the_plan():
    clock = FakeClock()
    pqs = {mq: ProcessQueue(mq, 0, clock()) for mq in q(0, 1, 2)}
    clock.advance(100)
    pqs[MessageQueue("T", 0)].last_pull = clock()  # pulls of 0 and 2 keep coming back
    pqs[MessageQueue("T", 2)].last_pull = clock()
    clock.advance(20.5)  # queue 1 has not pulled for 120.5 s
    stalled = [mq for mq, pq in pqs.items() if pq.pull_expired(clock(), 120.0)]
    assert stalled == q(1)
    plan = plan_rebalance(pqs, q(0, 1, 2), stalled)
    assert plan.revoke == q(1) and plan.assign == q(1)


# ================================================================ group simulation
# Real PushConsumers (rebalance loop, plan, drain, commit, release, pull loops) against the
# in-memory FakeBroker with the real access-lock table, in virtual time: a scenario of
# minutes runs in milliseconds, the same way every time.
GROUP = "g"
N_QUEUES = 16


class SimGroup:
    """Members joining and leaving one consumer group; listeners only record."""

    def __init__(self, broker: FakeBroker, clock: FakeClock, handler_s: float = 0.2,
                 **consumer_kw) -> None:
        self.broker = broker
        # the group failed a message before: its retry topic exists (the broker creates it
        # at a group's first send-back), so every member also balances a second topic
        if "%RETRY%g" not in broker.topics:
            broker.create_topic("%RETRY%g", 1)
        self.clock = clock
        self.handler_s = handler_s
        self.kw = {"consume_from": "FIRST", **consumer_kw}
        self.members: dict[str, PushConsumer] = {}
        self.deliveries: list[tuple[MessageQueue, int, str]] = []
        self.keys: Counter[str] = Counter()
        self.active: dict[MessageQueue, Counter[str]] = {}
        self.overlaps: list[tuple[float, MessageQueue, list[str]]] = []

    def _listener(self, name: str):
        async def listener(msgs, ctx):
            running = self.active.setdefault(ctx.queue, Counter())
            running[name] += 1
            others = sorted(n for n, k in running.items() if k and n != name)
            if others:  # recorded, asserted by the test: an assert here becomes a retry
                self.overlaps.append((self.clock(), ctx.queue, [name, *others]))
            for m in msgs:
                self.deliveries.append((ctx.queue, m.queue_offset, name))
                self.keys[m.unique_key] += 1
            try:
                await asyncio.sleep(self.handler_s)
            finally:
                running[name] -= 1
        return listener

    async def join(self, name: str) -> PushConsumer:
        c = PushConsumer("fake:9876", GROUP, self._listener(name), client_id=name,
                         clock=self.clock, connect=self.broker.connect, **self.kw)
        c.subscribe("T")
        self.members[name] = c
        return await c.start()

    async def leave(self, name: str) -> None:
        await self.members.pop(name).shutdown()

    def queues(self) -> list[MessageQueue]:
        return [MessageQueue("T", i) for i in range(N_QUEUES)] + [MessageQueue("%RETRY%g", 0)]

    def expected_assignment(self) -> dict[str, list[MessageQueue]]:
        ids = sorted(self.members)
        t = [mq for mq in self.queues() if mq.topic == "T"]
        r = [mq for mq in self.queues() if mq.topic != "T"]
        return {cid: sorted(allocate_average(cid, t, ids) + allocate_average(cid, r, ids))
                for cid in ids}

    def assert_stable(self) -> None:
        """Every queue owned by exactly one member, as the strategy says; with the lock on,
        the broker's lock holder of each queue is its owner."""
        owned = {cid: c.assignment for cid, c in self.members.items()}
        assert owned == self.expected_assignment(), f"at t={self.clock():.1f}"
        if self.broker.access_lock:
            holders = {mq: self.broker.holder(GROUP, mq.topic, mq.queue_id)
                       for mq in self.queues()}
            assert holders == {mq: cid for cid, qs in owned.items() for mq in qs}

    async def shutdown(self) -> None:
        for name in list(self.members):
            await self.leave(name)


async def _produce(broker: FakeBroker, stop: asyncio.Event, every: float = 0.1) -> list[str]:
    keys: list[str] = []
    for i in itertools.count():
        if stop.is_set():
            return keys
        keys += broker.put("T", i % N_QUEUES)
        await asyncio.sleep(every)
    return keys


async def _run_script(group: SimGroup, script: list[tuple[float, str, str]],
                      settle: float = 60.0) -> list[str]:
    """Play ``(time, "join" | "leave", name)`` while messages flow; let the group settle,
    check it is stable, shut it down; return the keys produced."""
    stop = asyncio.Event()
    producer = asyncio.create_task(_produce(group.broker, stop))
    t0 = group.clock()
    for at, action, name in script:
        await asyncio.sleep(max(0.0, t0 + at - group.clock()))
        await (group.join(name) if action == "join" else group.leave(name))
    await asyncio.sleep(5.0)
    stop.set()
    keys = await producer
    deadline = group.clock() + 3600.0  # slow listeners need a while for the backlog
    while set(keys) - set(group.keys) and group.clock() < deadline:
        await asyncio.sleep(1.0)
    await asyncio.sleep(settle)  # longer than a rebalance interval plus the drains
    group.assert_stable()
    await group.shutdown()
    return keys


def _lock_on_outcome(group: SimGroup, keys: list[str]) -> None:
    assert set(group.keys) == set(keys), "messages lost"
    assert group.overlaps == [], "a queue was consumed by two members at once"
    dups = {k: n for k, n in group.keys.items() if n > 1}
    assert dups == {}, f"{len(dups)} messages delivered more than once"


def test_scripted_joins_and_leaves_hand_queues_over_without_overlap():
    script = [(0.0, "join", "c1"), (3.0, "join", "c2"), (7.5, "join", "c3"),
              (30.0, "leave", "c2"), (31.0, "join", "c4"), (50.0, "leave", "c1"),
              (50.5, "leave", "c3"), (70.0, "leave", "c4"), (80.0, "join", "c5")]

    async def main(clock: FakeClock):
        broker = FakeBroker(clock)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock)
        keys = await _run_script(group, script)
        return group, keys

    group, keys = run_virtual(main)
    _lock_on_outcome(group, keys)
    runs = moved(group.deliveries)
    # queues changed hands while messages flowed (c1 -> ... -> c5 for every queue of T)
    assert {mq.queue_id for mq in runs if mq.topic == "T"} == set(range(N_QUEUES)), runs
    assert all(seq[0] == "c1" and seq[-1] == "c5" for mq, seq in runs.items()
               if mq.topic == "T")


def test_without_the_lock_members_overlap_and_repeat_messages():
    """The same handovers with the broker's lock off: the simulation sees what the lock
    prevents (so the checks above can fail)."""
    script = [(0.0, "join", "a"), (5.0, "join", "b"), (12.0, "leave", "a")]

    async def main(clock: FakeClock):
        broker = FakeBroker(clock, access_lock=False)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, handler_s=2.0)
        return group, await _run_script(group, script)

    group, keys = run_virtual(main)
    assert set(group.keys) == set(keys)  # nothing lost
    assert group.overlaps, "no queue was consumed by two members at once"
    assert max(group.keys.values()) > 1


def test_without_notifications_members_converge_within_one_interval():
    """Notifications lost: each member still rebalances on its own timer."""
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, notify=False)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, rebalance_interval_s=20.0)
        for name in ("a", "b", "c"):
            await group.join(name)  # each rebalances at start
        await asyncio.sleep(21.0)  # a's and b's timers ran once more and saw c
        group.assert_stable()
        before = {n: c.assignment for n, c in group.members.items()}
        joined = clock()
        await group.join("d")  # silently: nobody is told
        await asyncio.sleep(1.0)
        unchanged = all(group.members[n].assignment == before[n] for n in before)
        await asyncio.sleep(joined + 20.5 - clock())
        group.assert_stable()  # every timer fired once since d joined
        await group.shutdown()
        return unchanged, group

    unchanged, group = run_virtual(main)
    assert unchanged, "members rebalanced without a notification before their interval"
    assert group.overlaps == []


def test_a_stalled_queue_is_dropped_and_taken_again():
    async def main(clock: FakeClock):
        broker = FakeBroker(clock)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, rebalance_interval_s=20.0)
        await group.join("a")
        await asyncio.sleep(1.0)
        broker.black_holes.add(("T", 3))  # pulls of T:3 stop coming back
        broker.put("T", 3)
        # its last pull came back at about t=1 s: expired at 121 s (pull_expire_s), seen by
        # the rebalance at 140 s (every 20 s)
        await asyncio.sleep(145.0)
        released = [h for cid, code, h in broker.requests
                    if code == RequestCode.RELEASE_QUEUE and h["queue"] == 3]
        taken = [h for cid, code, h in broker.requests
                 if code == RequestCode.GET_OFFSET and h["topic"] == "T" and h["queue"] == 3]
        broker.black_holes.clear()
        key = broker.put("T", 3)[0]
        await asyncio.sleep(30.0)  # the pull lost in the hole times out (25 s), the next works
        group.assert_stable()
        await group.shutdown()
        return released, taken, key, group

    released, taken, key, group = run_virtual(main)
    assert len(released) == 1 and len(taken) == 2  # dropped once and taken again
    assert group.keys[key] == 1 and group.keys["T-3-0"] == 1


@st.composite
def scripts(draw) -> list[tuple[float, str, str]]:
    """A random membership history: joins and graceful leaves at random times."""
    names = iter(f"m{i:02d}" for i in range(100))
    present: list[str] = []
    script: list[tuple[float, str, str]] = []
    t = 0.0
    for _ in range(draw(st.integers(1, 8))):
        t += draw(st.sampled_from([0.0, 0.05, 0.5, 3.0, 25.0]))
        if present and draw(st.booleans()):
            name = present.pop(draw(st.integers(0, len(present) - 1)))
            script.append((t, "leave", name))
        elif len(present) < 5:
            name = next(names)
            present.append(name)
            script.append((t, "join", name))
    if not present:
        script.append((t + 1.0, "join", next(names)))
    return script


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), handler_s=st.sampled_from([0.0, 0.3, 4.0]),
       latency=st.sampled_from([0.0005, 0.01, 0.2]), access_lock=st.booleans())
def test_random_membership_every_queue_ends_with_one_owner_nothing_lost(
        script, handler_s, latency, access_lock):
    """Lock on: also no queue consumed by two members at once and no message twice. Lock
    off: duplicates are allowed, loss and a split assignment are not."""
    async def main(clock: FakeClock):
        broker = FakeBroker(clock, latency=latency, access_lock=access_lock)
        broker.create_topic("T", N_QUEUES)
        group = SimGroup(broker, clock, handler_s=handler_s)
        return group, await _run_script(group, script)  # checks the stable assignment

    group, keys = run_virtual(main)
    if access_lock:
        _lock_on_outcome(group, keys)
    else:
        assert set(group.keys) == set(keys), "messages lost"
