"""The queues a push consumer owns now.

One object, owned by the consumer: the rebalance changes it (take, revoke), the pull loops
and consume services read it. Work started for a process queue (a pull, a listener call, a
commit) asks :meth:`Assignment.active` before it acts on the result: the queue may have
been revoked, reset, lost or taken again meanwhile (a new process queue then stands for
it), and then the result belongs to nobody.
"""

from __future__ import annotations

from collections.abc import Iterator

from .allocation import MessageQueue
from .process_queue import ProcessQueue


class Assignment:
    __slots__ = ("_pqs",)

    def __init__(self) -> None:
        self._pqs: dict[MessageQueue, ProcessQueue] = {}

    def take(self, pq: ProcessQueue) -> None:
        self._pqs[pq.mq] = pq

    def revoke(self, pq: ProcessQueue) -> None:
        """Stop work on ``pq`` now (it stays listed until :meth:`forget`, while it drains)."""
        pq.dropped = True

    def forget(self, pq: ProcessQueue) -> None:
        """``pq`` was released: it is no longer owned."""
        pq.dropped = pq.released = True
        if self._pqs.get(pq.mq) is pq:
            del self._pqs[pq.mq]

    def active(self, pq: ProcessQueue) -> bool:
        """Whether ``pq`` is still the owned, undropped process queue of its queue."""
        return not pq.dropped and self._pqs.get(pq.mq) is pq

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
