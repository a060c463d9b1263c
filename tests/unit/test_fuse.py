"""The queue-depth fuse (``broker/fuse.py``): depth, trip and resume, per-topic limits,
and, as a property, a backlog that never grows past the limit by more than one batch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.fuse import QueueFuse, depth, parse_topic_limits
from onceq.protocol.errors import ErrorCode, OnceqError


class _Queue:
    def __init__(self) -> None:
        self.end = 0
        self.committed: dict[str, int] = {}

    def fuse(self, limit: int, topics: dict[str, int] | None = None,
             ratio: float = 0.8) -> QueueFuse:
        return QueueFuse(limit, topics or {}, ratio, lambda t, q: self.end,
                         lambda t, q: self.committed.values())


def _accepted(fuse: QueueFuse, topic: str = "t") -> bool:
    try:
        fuse.check(topic, 0)
    except OnceqError as exc:
        assert exc.code == ErrorCode.QUEUE_FULL and exc.retriable
        assert exc.details["depth"] >= 0
        return False
    return True


def test_depth_counts_from_the_slowest_group_that_committed() -> None:
    assert depth(100, []) == 0
    assert depth(100, [-1, -1]) == 0  # nobody committed: nothing to count against
    assert depth(100, [90, 40, -1]) == 60
    assert depth(10, [12]) == 0


def test_a_fuse_trips_at_the_limit_and_closes_below_the_resume_mark() -> None:
    q = _Queue()
    fuse = q.fuse(10)
    q.committed = {"slow": 0, "fast": 0}
    q.end = 9
    assert _accepted(fuse)
    q.end = 10
    assert not _accepted(fuse) and fuse.tripped == {("t", 0)}
    q.committed["fast"] = 10  # the fast group does not count: the slow one does
    assert not _accepted(fuse)
    q.committed["slow"] = 1  # depth 9: above the resume mark 8
    assert not _accepted(fuse)
    q.committed["slow"] = 2  # depth 8
    assert _accepted(fuse) and fuse.tripped == set()
    assert fuse.refused == 3
    assert fuse.status("t", 1) == {"limit": 10, "depths": [8], "tripped": []}


def test_per_topic_limits_and_their_parse_errors() -> None:
    q = _Queue()
    q.committed = {"g": 0}
    q.end = 50
    fuse = q.fuse(0, parse_topic_limits("orders=10, audit=0"))
    assert fuse.enabled
    assert not _accepted(fuse, "orders")
    assert _accepted(fuse, "audit") and _accepted(fuse, "other")
    assert not q.fuse(0).enabled
    for bad in ("orders", "orders=x", "=5", "orders=-1"):
        with pytest.raises(ValueError, match="topic=depth"):
            parse_topic_limits(bad)
    assert parse_topic_limits("") == {}


@given(st.integers(1, 50), st.floats(0, 0.99),
       st.lists(st.tuples(st.booleans(), st.integers(1, 20)), max_size=200))
def test_the_backlog_never_passes_the_limit_by_more_than_one_batch(
        limit: int, ratio: float, steps: list[tuple[bool, int]]) -> None:
    """Sends of batches and commits of the slowest group in any order: a batch is
    accepted only below the limit, so the backlog stays under limit + the largest batch;
    and a queue that was consumed to its end always takes the next send."""
    q = _Queue()
    q.committed = {"g": 0}
    fuse = q.fuse(limit, ratio=ratio)
    for send, n in steps:
        if send:
            if _accepted(fuse):
                q.end += n
            assert q.end - q.committed["g"] < limit + 20
        else:
            q.committed["g"] = min(q.end, q.committed["g"] + n)
            if q.committed["g"] == q.end:
                assert _accepted(fuse)
