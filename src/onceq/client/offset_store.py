"""Where a push consumer keeps its offsets: on the broker (CLUSTERING) or in a local file
(BROADCASTING). The consumer talks to one :class:`OffsetStore` and has no model branches.

An offset here is the next offset to consume (the process queue's ack offset).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import OffsetReply
from ..protocol.requests import CommitOffset, GetOffset, ReleaseQueue
from .allocation import MessageQueue
from .assignment import Assignment
from .connection import BrokerConnection, call
from .local_offsets import LocalOffsetStore
from .process_queue import ProcessQueue
from .requester import Requester

log = logging.getLogger("onceq.consumer")


class OffsetStore:
    """Offsets of the owned queues. ``started`` is called when a queue is taken, ``forget``
    when it is released; ``commit`` only moves an offset forward."""

    async def read(self, mq: MessageQueue) -> int | None:
        """The stored offset of ``mq`` (None: none)."""
        raise NotImplementedError

    def started(self, mq: MessageQueue, offset: int, stored: bool) -> None:
        """``mq`` is consumed from ``offset``; ``stored``: that is the stored offset (a start
        chosen by policy is not stored yet, and the first commit must store it)."""

    def forget(self, mq: MessageQueue) -> None:
        """``mq`` was released or dropped."""

    def piggyback(self, mq: MessageQueue, offset: int) -> int | None:
        """The offset to carry on the next pull of ``mq`` (None: nothing to carry)."""
        return None

    def carried(self, mq: MessageQueue, offset: int) -> None:
        """A pull that carried ``offset`` was answered (not refused): it is stored."""

    def moved_back(self, mq: MessageQueue) -> None:
        """The broker moved ``mq`` back (its log was cut): the lower offset must be stored."""

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        raise NotImplementedError

    async def release(self, pq: ProcessQueue) -> None:
        """End of a revoke: store the final offset of ``pq`` and give the queue up."""
        await self.commit(pq.mq, pq.commit_offset)

    async def flush(self) -> None:
        """Make the commits so far durable where that is the store's job."""

    async def reconnected(self, conn: BrokerConnection, holds: list[list[Any]],
                          owned: list[tuple[MessageQueue, ProcessQueue]]) -> None:
        """A new broker connection: send again what the broker may have lost."""


class LocalOffsets(OffsetStore):
    """BROADCASTING: every member keeps its own offsets in a local file."""

    def __init__(self, file: LocalOffsetStore) -> None:
        self.file = file

    async def read(self, mq: MessageQueue) -> int | None:
        return self.file.get(mq)

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        self.file.set(mq, offset)

    async def flush(self) -> None:
        self.file.save()


class BrokerOffsets(OffsetStore):
    """CLUSTERING: the group's offsets live on the broker. Commits ride on pulls, run every
    ``commit_interval_s`` and at revoke (with the release of the access lock)."""

    def __init__(self, requester: Requester, assignment: Assignment) -> None:
        self.r = requester
        self.assignment = assignment
        self._stored: dict[MessageQueue, int] = {}  # what the broker is known to have
        self._refused: dict[MessageQueue, int] = {}  # a commit refused with NOT_HOLDER

    def _get(self, mq: MessageQueue) -> GetOffset:
        return GetOffset(self.r.group, mq.topic, mq.queue_id)

    def _commit(self, mq: MessageQueue, offset: int) -> CommitOffset:
        r = self.r
        return CommitOffset(r.group, mq.topic, mq.queue_id, offset, r.client_id, r.reset_gen)

    async def read(self, mq: MessageQueue) -> int | None:
        reply: OffsetReply = await self.r.call(self._get(mq))
        return reply.committed

    def started(self, mq: MessageQueue, offset: int, stored: bool) -> None:
        self._refused.pop(mq, None)
        if stored:
            self._stored[mq] = offset
        else:
            self._stored.pop(mq, None)

    def forget(self, mq: MessageQueue) -> None:
        self._stored.pop(mq, None)
        self._refused.pop(mq, None)

    def unknown(self, mq: MessageQueue) -> None:
        """Forget what the broker has for ``mq``: the next commit is sent whatever it is."""
        self._stored.pop(mq, None)

    def _due(self, mq: MessageQueue, offset: int) -> bool:
        stored = self._stored.get(mq)
        return stored is None or offset > stored

    def piggyback(self, mq: MessageQueue, offset: int) -> int | None:
        return offset if self._due(mq, offset) else None

    def carried(self, mq: MessageQueue, offset: int) -> None:
        self._know(mq, offset)

    def _know(self, mq: MessageQueue, offset: int) -> None:
        """The broker has ``offset`` (or more) for ``mq``."""
        stored = self._stored.get(mq)
        self._stored[mq] = offset if stored is None else max(stored, offset)

    moved_back = unknown

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        if not self._due(mq, offset) or self._refused.get(mq) == offset:
            return
        try:
            await self.r.call(self._commit(mq, offset))
        except OnceqError as exc:
            if exc.code == ErrorCode.OFFSET_BEHIND:  # the group moved on without this
                pq = self.assignment.get(mq)  # member (it was away): its process queue is
                if pq is not None:  # stale
                    self.r.lose([pq], exc.message)
                return
            if exc.code != ErrorCode.NOT_HOLDER:
                raise
            # this member lost the queue's lock (a rebalance or an offset reset is under
            # way): not an error, and not worth repeating. A pull that gets the lock back
            # carries the commit; otherwise the rebalance drops the queue
            log.debug("commit of %s refused: %s", mq, exc.message)
            self._refused[mq] = offset
            self.r.stats["commits_refused"] += 1
            return
        self._stored[mq] = offset

    async def release(self, pq: ProcessQueue) -> None:
        """Commit, then give the access lock up in one call: no wait for the next owner."""
        r = self.r
        await r.call(ReleaseQueue(r.group, r.client_id, pq.mq.topic, pq.mq.queue_id,
                                  None if pq.stale else pq.commit_offset, r.reset_gen))

    async def reconnected(self, conn: BrokerConnection, holds: list[list[Any]],
                          owned: list[tuple[MessageQueue, ProcessQueue]]) -> None:
        """Commit again the offsets of work finished on held queues.

        A restarted broker may have lost commits made since its last offsets snapshot; the
        process queues kept across the reconnect know them. Only queues this consumer still
        holds (the heartbeat answer says so when the access lock applies), and never moving
        an offset backwards (the stored one is read first).
        """
        group = self.r.group
        refused = {(t, q) for g, t, q, h in holds if g == group and not h}
        todo = [(mq, pq.commit_offset) for mq, pq in owned
                if not pq.released and pq.commit_offset >= 0
                and (mq.topic, mq.queue_id) not in refused]

        async def one(mq: MessageQueue, ack: int) -> None:
            reply: OffsetReply = await call(conn, self._get(mq))
            if ack <= reply.offset:
                self._know(mq, reply.offset)
                return
            # NOT_HOLDER (another member holds it now) lands below: the next pull commits
            await call(conn, self._commit(mq, ack))
            self._stored[mq] = ack
            self.r.stats["offsets_resent"] += 1

        results = await asyncio.gather(*(one(mq, ack) for mq, ack in todo),
                                       return_exceptions=True)
        for (mq, _ack), res in zip(todo, results, strict=True):
            if isinstance(res, OnceqError):
                log.debug("offset of %s not sent again: %s", mq, res)
                self._stored.pop(mq, None)  # the next pull commits it
            elif isinstance(res, BaseException):
                raise res
