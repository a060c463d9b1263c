"""POP-style consumption on onceq's consumer-group offsets (pure: no I/O, time passed in).

RocketMQ 5's SimpleConsumer receives messages that stay invisible to the rest of the group
for an invisible duration, acknowledges them one by one with a receipt handle, and gets
back a message it did not acknowledge in time. onceq keeps one committed offset per
(group, topic, queue); this table keeps, beside it, per queue:

* ``next``: the first offset never handed out. Every offset below it was delivered to
  some consumer of the group or passed over by the group's tag filter;
* ``inflight``: the offsets delivered and not acknowledged yet, each with its delivery
  (generation, when it becomes visible again, delivery attempt).

The offset the group may commit is the lowest offset still in flight, or ``next`` when
none is (``QueuePop.commit_point``): the same rule as a push consumer's process queue, so
the group's committed offset moves past a message only once it was acknowledged (or
filtered out), never backwards. A message whose invisible duration ran out is delivered
again with a new generation; the receipt handles of its earlier deliveries are then
stale.

FIFO groups (``groups.py``) take a queue's messages one run at a time: while a delivery of
a queue is invisible (in flight, not acknowledged), the queue hands out nothing, neither new
messages nor deliveries of it that became visible again (``QueuePop.blocked``); once all of
its deliveries are visible again they are delivered again in offset order before anything
new (``due(fifo=True)``). So a message is consumed only after every earlier one of its queue
was acknowledged (or dead-lettered), also across a redelivery.

Each delivery counts its attempt (1 at the first); ``prior`` attempts (journaled before a
broker restart) carry on. A message whose attempts reach the group's maximum goes to the
dead-letter queue instead of being delivered again (``consume.py``). While it is being
moved there its delivery is ``settling``: not due, not visible to a FIFO queue's gate, and
its receipt handle settles nothing (``StaleReceipt``), so no receive delivers it again and no
acknowledgement or change acts on it until the move is stored (or failed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_INFLIGHT_PER_QUEUE = 20_000  # beyond, a queue hands out nothing new until acks come


class StaleReceipt(Exception):
    """The delivery a receipt handle names is not the message's current one."""


@dataclass(slots=True)
class Delivery:
    generation: int
    visible_at: float  # when the message may be delivered again (the clock's seconds)
    attempt: int  # 1 at the first delivery
    settling: bool = False  # being moved to the dead-letter queue (awaiting the store)

    def due(self, now: float) -> bool:
        """Visible again: it may be delivered again (or dead-lettered)."""
        return self.visible_at <= now and not self.settling


@dataclass(slots=True)
class QueuePop:
    next: int  # first offset never handed out
    committed: int  # the group's committed offset, as last read or written here
    inflight: dict[int, Delivery] = field(default_factory=dict)

    def commit_point(self) -> int:
        """The offset the group may commit: everything below it is acknowledged or
        filtered out."""
        return min(self.inflight) if self.inflight else self.next

    @property
    def full(self) -> bool:
        return len(self.inflight) >= MAX_INFLIGHT_PER_QUEUE

    def blocked(self, now: float) -> bool:
        """For a FIFO group: a delivery of the queue is still invisible, so nothing of the
        queue may be handed out."""
        return any(d.visible_at > now or d.settling for d in self.inflight.values())


Key = tuple[str, str]  # (group, topic)


class PopTable:
    """The POP state of every (group, topic) consumed through the RocketMQ front end."""

    def __init__(self, first_generation: int = 1,
                 generations: Callable[[], int] | None = None) -> None:
        self._topics: dict[Key, dict[int, QueuePop]] = {}
        self._generation = first_generation
        self._generations = generations  # a source shared with other tables

    def _next_generation(self) -> int:
        if self._generations is not None:
            return self._generations()
        g = self._generation
        self._generation += 1
        return g

    # ---------------------------------------------------------------- cursors
    def queue(self, group: str, topic: str, queue: int) -> QueuePop | None:
        return self._topics.get((group, topic), {}).get(queue)

    def start(self, group: str, topic: str, queue: int, committed: int, first: int
              ) -> QueuePop:
        """(Re)start a queue at the group's committed offset (``first`` when it has none);
        deliveries in flight are forgotten (their handles become stale)."""
        start = committed if committed >= 0 else first
        q = QueuePop(start, committed)
        self._topics.setdefault((group, topic), {})[queue] = q
        return q

    def queues(self, group: str, topic: str) -> dict[int, QueuePop]:
        return dict(self._topics.get((group, topic), {}))

    def topics(self) -> list[Key]:
        return list(self._topics)

    def forget_queue(self, group: str, topic: str, queue: int) -> None:
        qs = self._topics.get((group, topic))
        if qs is not None:
            qs.pop(queue, None)
            if not qs:
                del self._topics[(group, topic)]

    def forget_topic(self, topic: str) -> None:
        for key in [k for k in self._topics if k[1] == topic]:
            del self._topics[key]

    # ---------------------------------------------------------------- deliveries
    def deliver(self, group: str, topic: str, queue: int, offset: int, invisible_s: float,
                now: float, prior: int = 0) -> Delivery:
        """Hand ``offset`` out (first time or again) for ``invisible_s`` seconds; ``prior``:
        its deliveries before this table knew it (a restart), when it is not in flight."""
        q = self._topics[(group, topic)][queue]
        prev = q.inflight.get(offset)
        d = Delivery(self._next_generation(), now + invisible_s,
                     prior + 1 if prev is None else prev.attempt + 1)
        q.inflight[offset] = d
        q.next = max(q.next, offset + 1)
        return d

    def due(self, group: str, topic: str, now: float, fifo: bool = False
            ) -> list[tuple[int, int]]:
        """(queue, offset) of the deliveries visible again, the longest waiting first; for
        a FIFO group only those of queues with no invisible delivery, in offset order."""
        qs = self._topics.get((group, topic), {})
        if fifo:
            return [(qid, off) for qid, q in sorted(qs.items()) if not q.blocked(now)
                    for off in sorted(q.inflight)]
        out = [(d.visible_at, qid, off) for qid, q in qs.items()
               for off, d in q.inflight.items() if d.due(now)]
        return [(qid, off) for _t, qid, off in sorted(out)]

    def still_due(self, group: str, topic: str, queue: int, offset: int, now: float) -> bool:
        """Whether the delivery is in flight and visible again (another receive may have
        delivered it again since it was listed ``due``)."""
        q = self.queue(group, topic, queue)
        d = None if q is None else q.inflight.get(offset)
        return d is not None and d.due(now)

    def attempt(self, group: str, topic: str, queue: int, offset: int) -> int:
        """The attempt of the message's current delivery (0: not in flight)."""
        q = self.queue(group, topic, queue)
        d = None if q is None else q.inflight.get(offset)
        return 0 if d is None else d.attempt

    def next_visible(self, group: str, topic: str) -> float | None:
        """When the next delivery in flight becomes visible again (None: none in flight;
        one being moved to the dead-letter queue does not count)."""
        times = [d.visible_at for q in self._topics.get((group, topic), {}).values()
                 for d in q.inflight.values() if not d.settling]
        return min(times) if times else None

    def _current(self, group: str, topic: str, queue: int, offset: int, generation: int
                 ) -> tuple[QueuePop, Delivery]:
        q = self.queue(group, topic, queue)
        d = None if q is None else q.inflight.get(offset)
        if q is None or d is None:
            raise StaleReceipt(f"message {topic}:{queue}:{offset} of group {group} is not in "
                               "flight: acknowledged already, or the broker restarted")
        if d.generation != generation:
            raise StaleReceipt(f"message {topic}:{queue}:{offset} of group {group} was "
                               "delivered again after its invisible duration: only the "
                               "newest receipt handle counts")
        if d.settling:
            raise StaleReceipt(f"message {topic}:{queue}:{offset} of group {group} is being "
                               "moved to its dead-letter queue")
        return q, d

    def current(self, group: str, topic: str, queue: int, offset: int, generation: int
                ) -> Delivery:
        """The delivery a receipt names, if it is the message's current one (else
        ``StaleReceipt``)."""
        return self._current(group, topic, queue, offset, generation)[1]

    def ack(self, group: str, topic: str, queue: int, offset: int, generation: int
            ) -> QueuePop:
        """Settle a delivery; returns its queue (its ``commit_point`` may have moved)."""
        q, _d = self._current(group, topic, queue, offset, generation)
        del q.inflight[offset]
        return q

    def change(self, group: str, topic: str, queue: int, offset: int, generation: int,
               invisible_s: float, now: float) -> Delivery:
        """A new invisible duration from now, under a new generation (a new handle)."""
        q, d = self._current(group, topic, queue, offset, generation)
        nd = Delivery(self._next_generation(), now + invisible_s, d.attempt)
        q.inflight[offset] = nd
        return nd

    def drop(self, group: str, topic: str, queue: int, offset: int) -> None:
        """A delivery whose message is gone from the store (retention): settled."""
        q = self.queue(group, topic, queue)
        if q is not None:
            q.inflight.pop(offset, None)

    def inflight_count(self, group: str, topic: str) -> int:
        return sum(len(q.inflight) for q in self._topics.get((group, topic), {}).values())
