"""Where a push consumer keeps its offsets: on the broker (CLUSTERING) or in a local file
(BROADCASTING). The consumer talks to one :class:`OffsetStore` and has no model branches.

An offset here is the next offset to consume (the process queue's ack offset).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..protocol.codes import RequestCode
from ..protocol.errors import ErrorCode, OnceqError
from .allocation import MessageQueue
from .connection import BrokerConnection
from .local_offsets import LocalOffsetStore
from .process_queue import ProcessQueue

if TYPE_CHECKING:
    from .push import PushConsumer

log = logging.getLogger("onceq.consumer")


class OffsetStore:
    """Offsets of the owned queues. ``started`` is called when a queue is taken, ``forget``
    when it is released; ``commit`` only moves an offset forward."""

    async def read(self, mq: MessageQueue) -> int:
        """The stored offset of ``mq`` (-1: none)."""
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

    async def read(self, mq: MessageQueue) -> int:
        return self.file.get(mq)

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        self.file.set(mq, offset)

    async def flush(self) -> None:
        self.file.save()


class BrokerOffsets(OffsetStore):
    """CLUSTERING: the group's offsets live on the broker. Commits ride on pulls, run every
    ``commit_interval_s`` and at revoke (with the release of the access lock)."""

    def __init__(self, consumer: PushConsumer) -> None:
        self.c = consumer
        self._stored: dict[MessageQueue, int] = {}  # what the broker is known to have
        self._refused: dict[MessageQueue, int] = {}  # a commit refused with NOT_HOLDER

    def _query(self, mq: MessageQueue) -> dict[str, Any]:
        return {"group": self.c.group, "topic": mq.topic, "queue": mq.queue_id}

    async def read(self, mq: MessageQueue) -> int:
        hdr, _ = await self.c._req(RequestCode.GET_OFFSET, self._query(mq))
        return int(hdr["offset"])

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
        return offset > self._stored.get(mq, -1)

    def piggyback(self, mq: MessageQueue, offset: int) -> int | None:
        return offset if self._due(mq, offset) else None

    def carried(self, mq: MessageQueue, offset: int) -> None:
        self._stored[mq] = max(self._stored.get(mq, -1), offset)

    moved_back = unknown

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        if not self._due(mq, offset) or self._refused.get(mq) == offset:
            return
        try:
            await self.c._req(RequestCode.COMMIT_OFFSET, {
                **self._query(mq), "offset": offset, "client": self.c.client_id,
                **self.c._gen()})
        except OnceqError as exc:
            if exc.code == ErrorCode.OFFSET_BEHIND:  # the group moved on without this
                pq = self.c.owned.get(mq)  # member (it was away): its process queue is stale
                if pq is not None:
                    self.c._lose([pq], exc.message)
                return
            if exc.code != ErrorCode.NOT_HOLDER:
                raise
            # this member lost the queue's lock (a rebalance or an offset reset is under
            # way): not an error, and not worth repeating. A pull that gets the lock back
            # carries the commit; otherwise the rebalance drops the queue
            log.debug("commit of %s refused: %s", mq, exc.message)
            self._refused[mq] = offset
            self.c.stats["commits_refused"] += 1
            return
        self._stored[mq] = offset

    async def release(self, pq: ProcessQueue) -> None:
        """Commit, then give the access lock up in one call: no wait for the next owner."""
        mq = pq.mq
        await self.c._req(RequestCode.RELEASE_QUEUE, {
            **self._query(mq), "client": self.c.client_id,
            "offset": -1 if pq.stale else pq.commit_offset, **self.c._gen()})

    async def reconnected(self, conn: BrokerConnection, holds: list[list[Any]],
                          owned: list[tuple[MessageQueue, ProcessQueue]]) -> None:
        """Commit again the offsets of work finished on held queues.

        A restarted broker may have lost commits made since its last offsets snapshot; the
        process queues kept across the reconnect know them. Only queues this consumer still
        holds (the heartbeat answer says so when the access lock applies), and never moving
        an offset backwards (the stored one is read first).
        """
        group = self.c.group
        refused = {(t, q) for g, t, q, h in holds if g == group and not h}
        todo = [(mq, pq.commit_offset) for mq, pq in owned
                if not pq.released and pq.commit_offset >= 0
                and (mq.topic, mq.queue_id) not in refused]

        async def one(mq: MessageQueue, ack: int) -> None:
            hdr, _ = await conn.request(RequestCode.GET_OFFSET, self._query(mq))
            stored = int(hdr["offset"])
            if ack <= stored:
                self._stored[mq] = max(self._stored.get(mq, -1), stored)
                return
            # NOT_HOLDER (another member holds it now) lands below: the next pull commits
            await conn.request(RequestCode.COMMIT_OFFSET, {
                **self._query(mq), "offset": ack, "client": self.c.client_id,
                **self.c._gen()})
            self._stored[mq] = ack
            self.c.stats["offsets_resent"] += 1

        results = await asyncio.gather(*(one(mq, ack) for mq, ack in todo),
                                       return_exceptions=True)
        for (mq, _ack), res in zip(todo, results, strict=True):
            if isinstance(res, OnceqError):
                log.debug("offset of %s not sent again: %s", mq, res)
                self._stored.pop(mq, None)  # the next pull commits it
            elif isinstance(res, BaseException):
                raise res
