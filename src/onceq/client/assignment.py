"""The queues a push consumer owns now, and their generations.

One object, owned by the consumer: the coordinator changes it (take, revoke, drop), the
fetcher and the consume services read it. Every take of a queue starts a new
**generation** (a number that only grows, stamped on the queue's process queue). Work
started for a process queue (a pull, a listener call, a commit) remembers the generation
it started under and asks :meth:`Assignment.current` before it applies its result: when
the queue was dropped (lost, reset) or released and taken again meanwhile, the result
belongs to nobody and is thrown away. A revoked queue stays current while it drains: the
work it finishes then is committed.
"""

from __future__ import annotations

from collections.abc import Iterator

from .allocation import MessageQueue
from .process_queue import ProcessQueue


class Assignment:
    __slots__ = ("_pqs", "generation")

    def __init__(self) -> None:
        self._pqs: dict[MessageQueue, ProcessQueue] = {}
        self.generation = 0  # of the last take

    def take(self, pq: ProcessQueue) -> None:
        """``pq`` is now its queue's process queue, under a new generation."""
        self.generation += 1
        pq.generation = self.generation
        replaced = self._pqs.get(pq.mq)
        if replaced is not None and replaced is not pq:
            replaced.dropped = replaced.released = True  # its queue is another's now
        self._pqs[pq.mq] = pq

    def revoke(self, pq: ProcessQueue) -> None:
        """Stop new work on ``pq`` now (it stays current until :meth:`forget`, while it
        drains)."""
        pq.dropped = True

    def drop(self, pq: ProcessQueue) -> None:
        """The group moved on without ``pq`` (lost, or its offsets reset): no new work,
        and no result of work under its generation applies any more."""
        pq.stale = pq.dropped = pq.released = True

    def forget(self, pq: ProcessQueue) -> None:
        """``pq`` was released: it is no longer owned."""
        pq.dropped = pq.released = True
        if self._pqs.get(pq.mq) is pq:
            del self._pqs[pq.mq]

    def active(self, pq: ProcessQueue) -> bool:
        """Whether new work may start on ``pq``: its queue's owned, undropped process
        queue."""
        return not pq.dropped and not pq.released

    @staticmethod
    def current(pq: ProcessQueue, generation: int) -> bool:
        """Whether work started on ``pq`` under ``generation`` may apply its result: the
        queue has not been dropped, released or taken again since (each take is a new
        generation; a process queue that leaves the assignment, or is replaced in it, is
        released)."""
        return pq.generation == generation and not pq.released

    def get(self, mq: MessageQueue) -> ProcessQueue | None:
        return self._pqs.get(mq)

    def items(self) -> list[tuple[MessageQueue, ProcessQueue]]:
        return list(self._pqs.items())

    def queues(self) -> list[MessageQueue]:
        return sorted(self._pqs)

    def __iter__(self) -> Iterator[MessageQueue]:
        return iter(list(self._pqs))

    def __contains__(self, mq: object) -> bool:
        return mq in self._pqs

    def __len__(self) -> int:
        return len(self._pqs)
