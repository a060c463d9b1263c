"""The queue-depth fuse (DeFiBus's): a queue whose backlog grows past a limit refuses
sends until its consumers catch up, so that one slow consumer group cannot grow the
broker's backlog without bound.

A queue's **depth** is how many of its messages the slowest consumer group has not
consumed: its end offset minus the lowest offset committed on it by any group (groups
that never committed on the queue do not count; with none, the depth is 0). Its fuse
**trips** when a send finds the depth at or above the limit: the send is refused
``QUEUE_FULL`` (56, retriable), so a batch accepted below the limit may take the backlog
past it by at most that batch. A tripped fuse **closes** again once the depth is at or
below the resume mark (hysteresis: no flapping around the limit).

Producers move unkeyed sends to the topic's other queues; a send with a sharding key (or
a queue of its own) waits and tries the same queue again within its send timeout, then
fails ``QUEUE_FULL``: a key's messages are never reordered (``client/producer.py``).

The limits: ``fuse_depth`` for every topic (0: no fuse), ``fuse_topics`` to set one per
topic (``"orders=10000,audit=0"``), ``fuse_resume_ratio`` (the resume mark as a share of
the limit, 0.8 by default). Pure but for the two lookups it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ..protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .config import BrokerConfig

Queue = tuple[str, int]


def parse_topic_limits(spec: str) -> dict[str, int]:
    """``"orders=10000,audit=0"`` -> ``{"orders": 10000, "audit": 0}``; ValueError naming
    the bad part."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        topic, sep, value = part.partition("=")
        topic = topic.strip()
        try:
            limit = int(value)
        except ValueError:
            limit = -1
        if not sep or not topic or limit < 0:
            raise ValueError(f"fuse_topics: {part!r} is not topic=depth (a whole number "
                             ">= 0)")
        out[topic] = limit
    return out


def depth(end: int, committed: Iterable[int]) -> int:
    """Messages of a queue ending at ``end`` that the slowest group has not consumed
    (``committed``: each group's committed offset, -1 when it has none)."""
    lowest = min((c for c in committed if c >= 0), default=None)
    return 0 if lowest is None else max(end - lowest, 0)


class QueueFuse:
    def __init__(self, limit: int, topic_limits: dict[str, int], resume_ratio: float,
                 end: Callable[[str, int], int],
                 committed: Callable[[str, int], Iterable[int]]) -> None:
        """``end(topic, queue)``: the queue's end offset; ``committed(topic, queue)``:
        the groups' committed offsets on it."""
        self.limit = limit
        self.topic_limits = topic_limits
        self.resume_ratio = resume_ratio
        self.end = end
        self.committed = committed
        self.tripped: set[Queue] = set()
        self.refused = 0  # sends refused QUEUE_FULL (metrics)

    @property
    def enabled(self) -> bool:
        return self.limit > 0 or any(v > 0 for v in self.topic_limits.values())

    def limit_of(self, topic: str) -> int:
        return self.topic_limits.get(topic, self.limit)

    def check(self, topic: str, queue: int) -> None:
        """Before a send to ``queue``: ``QUEUE_FULL`` while its fuse is tripped."""
        limit = self.limit_of(topic)
        key = (topic, queue)
        if limit <= 0:
            self.tripped.discard(key)
            return
        d = depth(self.end(topic, queue), self.committed(topic, queue))
        if key in self.tripped:
            if d > limit * self.resume_ratio:
                self._refuse(topic, queue, d, limit)
            self.tripped.discard(key)
        elif d >= limit:
            self.tripped.add(key)
            self._refuse(topic, queue, d, limit)

    def _refuse(self, topic: str, queue: int, d: int, limit: int) -> None:
        self.refused += 1
        raise OnceqError(ErrorCode.QUEUE_FULL, (
            f"queue {topic}:{queue} holds {d} messages its slowest consumer group has not "
            f"consumed (fuse at {limit}, sends again below "
            f"{int(limit * self.resume_ratio)}): send to another queue, or later"),
            {"topic": topic, "queue": queue, "depth": d})

    def status(self, topic: str, queues: int) -> dict[str, object]:
        """The topic's limit, each queue's depth and the tripped ones."""
        depths = [depth(self.end(topic, q), self.committed(topic, q)) for q in range(queues)]
        return {"limit": self.limit_of(topic), "depths": depths,
                "tripped": sorted(q for t, q in self.tripped if t == topic)}

    def summary(self) -> dict[str, object]:
        """What ``BROKER_STATUS`` says of the fuse."""
        return {"limit": self.limit, "topics": self.topic_limits,
                "resume_ratio": self.resume_ratio,
                "tripped": [list(k) for k in sorted(self.tripped)], "refused": self.refused}

    def forget_topic(self, topic: str) -> None:
        self.tripped = {k for k in self.tripped if k[0] != topic}


def store_fuse(config: BrokerConfig, store: MessageStore) -> QueueFuse | None:
    """The fuse of a broker's store as its settings say, None when it is off."""
    topics, offsets = store.topics, store.offsets

    def committed(topic: str, queue: int) -> Iterator[int]:
        key = str(queue)
        for by_topic in offsets.groups.values():
            queues = by_topic.get(topic)
            if queues is not None:
                yield queues.get(key, -1)

    fuse = QueueFuse(config.fuse_depth, parse_topic_limits(config.fuse_topics),
                     config.fuse_resume_ratio,
                     lambda topic, queue: topics.queue(topic, queue).max_offset, committed)
    return fuse if fuse.enabled else None
