"""Which queues a producer avoids (``client/queue_health.py``), on a fake clock."""

from __future__ import annotations

from onceq.client.queue_health import BACKOFF_MAX_S, SLOW_BACKOFF_S, QueueHealth
from onceq.protocol.errors import ErrorCode


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_queue_is_skipped_for_a_back_off_that_doubles_and_ends() -> None:
    clock = _Clock()
    h = QueueHealth(clock)
    assert [h.pick("t", 4, i) for i in range(4)] == [0, 1, 2, 3]
    h.failed("t", 2, ErrorCode.QUEUE_FULL)
    assert [h.pick("t", 4, i) for i in range(4)] == [0, 1, 3, 3]
    assert h.avoided == 1 and h.unhealthy() == {"t": [2]}
    clock.now += 1.0  # the first back-off is over: tried again
    assert h.pick("t", 4, 2) == 2
    h.failed("t", 2, ErrorCode.QUEUE_FULL)  # again: two seconds now
    clock.now += 1.5
    assert not h.healthy("t", 2)
    clock.now += 0.5
    assert h.healthy("t", 2)
    h.succeeded("t", 2, 0.01)  # a success ends the run
    h.failed("t", 2, ErrorCode.SYSTEM_BUSY)
    clock.now += 1.0
    assert h.healthy("t", 2)
    for _ in range(20):
        h.failed("t", 1, ErrorCode.STORAGE_ERROR)
    clock.now += BACKOFF_MAX_S - 0.1
    assert not h.healthy("t", 1)
    clock.now += 0.1
    assert h.healthy("t", 1)


def test_codes_of_the_connection_or_the_leader_do_not_count() -> None:
    h = QueueHealth(_Clock())
    for code in (ErrorCode.NOT_LEADER, ErrorCode.TOPIC_NOT_EXIST, ErrorCode.ACCESS_DENIED):
        h.failed("t", 0, code)
    assert h.healthy("t", 0) and h.unhealthy() == {}


def test_with_no_healthy_queue_the_one_back_soonest_is_picked() -> None:
    clock = _Clock()
    h = QueueHealth(clock)
    h.failed("t", 0, ErrorCode.QUEUE_FULL)
    h.failed("t", 0, ErrorCode.QUEUE_FULL)  # 2 s
    clock.now += 0.5
    h.failed("t", 1, ErrorCode.QUEUE_FULL)  # 1 s from now: back first
    assert h.all_unhealthy("t", 2)
    assert h.pick("t", 2, 0) == 1


def test_a_slow_success_makes_a_queue_unhealthy_for_a_while() -> None:
    clock = _Clock()
    h = QueueHealth(clock)
    h.succeeded("t", 3, 2.5)
    assert not h.healthy("t", 3)
    clock.now += SLOW_BACKOFF_S
    assert h.healthy("t", 3)
    h.succeeded("t", 3, 0.01)
    assert h.unhealthy() == {}
