"""Which queues a producer avoids for a while: DeFiBus's queue health manager and
RocketMQ's latency fault tolerance, per (topic, queue).

A send to a queue that fails with a code that says the queue cannot take it now (its fuse
is tripped, the broker is busy, the write failed or timed out) makes the queue
**unhealthy** for a back-off: ``BACKOFF_S`` after the first failure, doubled after each
further one in a row, at most ``BACKOFF_MAX_S``; a send that succeeds but took
``SLOW_S`` or more makes it unhealthy for ``SLOW_BACKOFF_S``. A success ends the run of
failures. An unkeyed send (no sharding key, queue or selector) goes to the next healthy
queue in round-robin order; when none is healthy, to the one whose back-off ends first
(the producer never refuses a send for lack of a healthy queue). A keyed send keeps its
queue whatever its health: a key's order matters more than the detour.

Pure: the clock is passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..protocol.errors import ErrorCode

BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
SLOW_S = 2.0
SLOW_BACKOFF_S = 5.0
# codes that speak of one queue (or the broker's writes) rather than of the connection
# or the group's leader (those are followed, not avoided: ``base.py``)
UNHEALTHY_ON = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_MOVING, ErrorCode.SYSTEM_BUSY,
                          ErrorCode.FLUSH_TIMEOUT, ErrorCode.STORAGE_ERROR,
                          ErrorCode.DISK_FULL, ErrorCode.SERVICE_UNAVAILABLE})


@dataclass(slots=True)
class _State:
    until: float = 0.0  # unhealthy before this time
    failures: int = 0  # in a row


class QueueHealth:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._queues: dict[tuple[str, int], _State] = {}
        self.avoided = 0  # unkeyed sends moved away from an unhealthy queue (stats)

    def failed(self, topic: str, queue: int, code: int) -> None:
        """A send to ``queue`` failed with ``code``."""
        if code not in UNHEALTHY_ON:
            return
        st = self._queues.setdefault((topic, queue), _State())
        st.failures += 1
        st.until = self.clock() + min(BACKOFF_S * 2 ** (st.failures - 1), BACKOFF_MAX_S)

    def succeeded(self, topic: str, queue: int, seconds: float) -> None:
        """A send to ``queue`` succeeded after ``seconds``."""
        st = self._queues.get((topic, queue))
        if seconds >= SLOW_S:
            st = self._queues.setdefault((topic, queue), _State())
            st.until = max(st.until, self.clock() + SLOW_BACKOFF_S)
        if st is not None:
            st.failures = 0
            if st.until <= self.clock():
                del self._queues[(topic, queue)]

    def healthy(self, topic: str, queue: int) -> bool:
        st = self._queues.get((topic, queue))
        return st is None or st.until <= self.clock()

    def all_unhealthy(self, topic: str, n: int) -> bool:
        return all(not self.healthy(topic, q) for q in range(n))

    def pick(self, topic: str, n: int, start: int, among: list[int] | None = None) -> int:
        """The queue of an unkeyed send whose round-robin turn is ``start`` (over
        ``among``, else all ``n`` queues): the first healthy one from there, else the one
        healthy again soonest."""
        queues = among or range(n)
        if not self._queues:
            return queues[start % len(queues)]
        for i in range(len(queues)):
            q = queues[(start + i) % len(queues)]
            if self.healthy(topic, q):
                if i:
                    self.avoided += 1
                return q
        self.avoided += 1
        return min(queues, key=lambda q: self._queues[(topic, q)].until)

    def unhealthy(self) -> dict[str, list[int]]:
        """The queues avoided now, per topic (for status and tests)."""
        now = self.clock()
        out: dict[str, list[int]] = {}
        for (topic, q), st in sorted(self._queues.items()):
            if st.until > now:
                out.setdefault(topic, []).append(q)
        return out
