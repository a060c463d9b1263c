"""Rebalance timing and planning, and a deterministic group simulation on a fake clock.

No sleeps and no sockets: time is a number the test moves forward.
"""

from __future__ import annotations

import random

import pytest

from onceq.client.allocation import MessageQueue, allocate_average
from onceq.client.process_queue import ProcessQueue
from onceq.client.rebalance import RebalanceTimer, plan_rebalance
from tests.clock import FakeClock

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
class SimMember:
    """What one push consumer does at a rebalance, minus the I/O: same timer, same plan."""

    def __init__(self, cid: str, clock: FakeClock, interval: float) -> None:
        self.cid = cid
        self.clock = clock
        self.timer = RebalanceTimer(interval, clock())
        self.owned: dict[MessageQueue, ProcessQueue] = {}
        self.rebalances = 0

    def tick(self, members: list[str], queues: list[MessageQueue]) -> None:
        now = self.clock()
        if not self.timer.due(now):
            return
        self.timer.done(now)
        self.rebalances += 1
        desired = allocate_average(self.cid, queues, members)
        stalled = [mq for mq, pq in self.owned.items() if pq.pull_expired(now, 120.0)]
        plan = plan_rebalance(self.owned, desired, stalled)
        for mq in plan.revoke:
            self.owned.pop(mq).dropped = True
        for mq in plan.assign:
            self.owned[mq] = ProcessQueue(mq, 0, now)
        for pq in self.owned.values():  # healthy pulls keep coming back
            pq.last_pull = now


class SimGroup:
    """The broker's member list: every change notifies each remaining member."""

    def __init__(self, clock: FakeClock, interval: float = 20.0) -> None:
        self.clock = clock
        self.interval = interval
        self.members: dict[str, SimMember] = {}

    def join(self, cid: str) -> None:
        self.members[cid] = SimMember(cid, self.clock, self.interval)
        self._notify()

    def leave(self, cid: str) -> None:
        del self.members[cid]  # graceful: its queues were released before unregistering
        self._notify()

    def _notify(self) -> None:
        for m in self.members.values():
            m.timer.notify()

    def step(self) -> None:
        ids = sorted(self.members)
        for m in self.members.values():
            m.tick(ids, QUEUES)

    def owners(self) -> dict[MessageQueue, list[str]]:
        out: dict[MessageQueue, list[str]] = {mq: [] for mq in QUEUES}
        for m in self.members.values():
            for mq in m.owned:
                out[mq].append(m.cid)
        return out

    def assert_exclusive_and_complete(self) -> None:
        owners = self.owners()
        if not self.members:
            assert all(not o for o in owners.values())
            return
        bad = {mq: o for mq, o in owners.items() if len(o) != 1}
        assert not bad, f"at t={self.clock():.1f} queues without exactly one owner: {bad}"
        sizes = sorted(len(m.owned) for m in self.members.values())
        assert sizes[-1] - sizes[0] <= 2  # average: 16 over n plus the retry queue


def test_simulation_scripted_join_and_leave():
    clock = FakeClock(0.0)
    group = SimGroup(clock)
    script = {0.0: ("join", "c1"), 3.0: ("join", "c2"), 7.5: ("join", "c3"),
              30.0: ("leave", "c2"), 31.0: ("join", "c4"), 50.0: ("leave", "c1"),
              50.5: ("leave", "c3"), 70.0: ("leave", "c4"), 80.0: ("join", "c5")}
    for _ in range(1000):  # 100 s in steps of 0.1 s
        event = script.get(round(clock(), 1))
        if event is not None:
            getattr(group, event[0])(event[1])
        group.step()  # every notified member rebalances in this same step
        group.assert_exclusive_and_complete()
        clock.advance(0.1)
    assert sorted(group.members) == ["c5"]
    assert len(group.members["c5"].owned) == len(QUEUES)


def test_simulation_without_notifications_converges_within_one_interval():
    """Notifications lost: each member still rebalances on its own timer."""
    clock = FakeClock(0.0)
    group = SimGroup(clock, interval=20.0)
    for cid in ("a", "b", "c"):
        group.members[cid] = SimMember(cid, clock, 20.0)
    group.step()
    group.assert_exclusive_and_complete()
    group.members["d"] = SimMember("d", clock, 20.0)  # joins silently
    for m in group.members.values():
        m.timer.done(clock())  # nobody is due for another 20 s
    group.step()
    assert len(group.members["d"].owned) == 0
    clock.advance(20.0)
    group.step()
    group.assert_exclusive_and_complete()
    assert len(group.members["d"].owned) > 0


@pytest.mark.parametrize("seed", range(20))
def test_simulation_random_membership(seed):
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    group = SimGroup(clock)
    names = iter(f"m{i:03d}" for i in range(1000))
    for _ in range(rng.randrange(1, 4)):
        group.join(next(names))
    for _ in range(300):
        r = rng.random()
        if r < 0.08 and len(group.members) < 8:
            group.join(next(names))
        elif r < 0.14 and group.members:
            group.leave(rng.choice(sorted(group.members)))
        elif r < 0.16:  # several changes at the same fake instant
            group.join(next(names))
            group.leave(rng.choice(sorted(group.members)))
        group.step()
        group.assert_exclusive_and_complete()
        clock.advance(rng.choice([0.1, 1.0, 5.0, 25.0, 130.0]))


def test_simulation_stalled_member_retakes_its_queue():
    clock = FakeClock(0.0)
    group = SimGroup(clock)
    for cid in ("a", "b"):
        group.join(cid)
    group.step()
    a = group.members["a"]
    mq = sorted(a.owned)[0]
    old = a.owned[mq]
    clock.advance(121.0)
    for other in [p for k, p in a.owned.items() if k != mq]:
        other.last_pull = clock()  # only mq stopped pulling
    a.timer.notify()
    a.tick(sorted(group.members), QUEUES)
    assert old.dropped and a.owned[mq] is not old and not a.owned[mq].dropped
    group.assert_exclusive_and_complete()
