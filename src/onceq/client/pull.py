"""Low-level pull consumer: pull a queue from an offset, commit and fetch offsets."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..log.record import MessageExt, decode_records
from ..protocol.codes import PullStatus
from ..protocol.errors import OnceqError
from ..protocol.replies import OffsetReply, PullReply, QueueOffsets
from ..protocol.requests import (
    CommitOffset,
    GetOffset,
    Pull,
    QueryOffsets,
    SearchOffset,
)
from .base import BrokerClient
from .security import ClientSecurity


@dataclass(slots=True)
class PullResult:
    status: PullStatus
    messages: list[MessageExt]
    next_offset: int
    min_offset: int
    max_offset: int
    payload: bytes = b""  # the stored records undecoded (``decode=False``)
    offset: int = 0  # the offset pulled (the first one of ``payload`` to keep)


_default_ids: Counter[str] = Counter()


def default_client_id(instance: str = "DEFAULT") -> str:
    """``host@pid#instance`` (RocketMQ's shape), made unique inside this process: the
    broker binds a client id to one connection, and two clients with the same id would be
    one member to it (or be refused: ``CLIENT_ID_IN_USE``)."""
    base = f"{socket.gethostname()}@{os.getpid()}#{instance}"
    _default_ids[base] += 1
    n = _default_ids[base]
    return base if n == 1 else f"{base}-{n}"


def parse_tags(expression: str | None) -> list[str] | None:
    """RocketMQ tag expression: ``*`` (all) or ``TagA || TagB``; None means all."""
    if expression is None or expression.strip() in ("", "*"):
        return None
    tags = [t.strip() for t in expression.split("||") if t.strip()]
    return tags or None


class PullConsumer(BrokerClient):
    """Pull messages queue by queue. Offsets are the caller's to keep, or the broker's via
    ``commit_offset``/``fetch_offset`` (the group's committed offsets)."""

    def __init__(self, address: str = "127.0.0.1:9876", group: str = "DEFAULT_GROUP", *,
                 client_id: str | None = None, verify_checksums: bool = True,
                 security: ClientSecurity | None = None) -> None:
        super().__init__(address, security=security)
        self.group = group
        self.client_id = client_id or default_client_id()
        self.verify = verify_checksums

    def _pull_request(self, topic: str, queue: int, offset: int, max_msgs: int,
                      tag_list: list[str] | None, suspend: float, commit_offset: int | None
                      ) -> Pull:
        return Pull(topic, queue, offset, max_msgs, group=self.group, client=self.client_id,
                    suspend_ms=int(suspend * 1000) if suspend > 0 else 0, tags=tag_list,
                    commit=commit_offset)

    def _result(self, reply: PullReply, tag_list: list[str] | None, offset: int,
                decode: bool = True) -> PullResult:
        if not decode:
            return PullResult(reply.status, [], reply.next, reply.min, reply.max,
                              reply.payload, offset)
        payload = reply.payload
        msgs = list(decode_records(payload, self.verify, offset, reply.next)
                    ) if payload else []
        if tag_list is not None:
            wanted = set(tag_list)
            msgs = [m for m in msgs if m.tags in wanted]
        return PullResult(reply.status, msgs, reply.next, reply.min, reply.max,
                          offset=offset)

    async def pull(self, topic: str, queue: int, offset: int, max_msgs: int = 32, *,
                   tags: str | None = None, suspend: float = 0.0,
                   commit_offset: int | None = None) -> PullResult:
        """Pull up to ``max_msgs`` from ``offset``. With ``suspend`` > 0 the broker holds an
        empty pull up to that many seconds (long polling) and answers when a message comes.
        ``commit_offset`` piggy-backs an offset commit for the group on the pull."""
        tag_list = parse_tags(tags)
        request = self._pull_request(topic, queue, offset, max_msgs, tag_list, suspend,
                                     commit_offset)
        reply = await self.links.call_at(topic, queue, request, timeout=suspend + 10.0)
        return self._result(reply, tag_list, offset)

    async def stream(self, topic: str, queue: int, offset: int, max_msgs: int = 32, *,
                     tags: str | None = None, suspend: float = 15.0, commit: bool = True,
                     decode: bool = True) -> AsyncIterator[PullResult]:
        """Pull a queue continuously from ``offset``, one pull always in flight.

        The next pull is sent as soon as a result arrives, before the caller works on it, so
        the broker prepares the next batch meanwhile (prefetch). With ``commit``, each pull
        carries the group's offset up to the batches the caller has finished (a batch is
        finished when the loop asks for the next one); commit the last batch yourself with
        ``commit_offset`` when you stop. Empty results (long polling timed out) are yielded
        too, so the caller can stop. Without ``decode`` a result carries the stored records
        undecoded in ``payload`` (for a caller with its own decoder; ``tags`` is then only
        the broker's hash filter, and a batch record may hold messages outside the pulled
        offsets: keep those from the pull's ``offset`` to its ``next_offset``, as
        ``decode_records`` does).
        """
        tag_list = parse_tags(tags)
        link = await self.links.link(topic, queue)  # the client of the queue's group
        conn = await link._connection()
        timeout = suspend + 10.0
        done = None  # offset up to which the caller has finished
        fut = conn.submit(self._pull_request(topic, queue, offset, max_msgs, tag_list,
                                             suspend, None))
        try:
            while True:
                try:
                    reply: PullReply = await asyncio.wait_for(fut, timeout)
                except OnceqError as exc:  # in a group: a stream started again goes to
                    await link._follow(exc)  # the leader (NOT_LEADER, a lost connection)
                    raise
                fut = conn.submit(self._pull_request(topic, queue, reply.next, max_msgs,
                                                     tag_list, suspend,
                                                     done if commit else None))
                yield self._result(reply, tag_list, offset, decode)
                offset = done = reply.next
        finally:
            fut.cancel()

    async def commit_offset(self, topic: str, queue: int, offset: int) -> None:
        await self.links.call_at(topic, queue, CommitOffset(self.group, topic, queue, offset))

    async def fetch_offset(self, topic: str, queue: int) -> int | None:
        """The group's committed offset for the queue, or None when there is none."""
        reply: OffsetReply = await self.links.call_at(topic, queue,
                                                      GetOffset(self.group, topic, queue))
        return reply.committed

    async def queue_offsets(self, topic: str, queue: int) -> tuple[int, int]:
        reply: QueueOffsets = await self.links.call_at(topic, queue, QueryOffsets(topic, queue))
        return reply.min, reply.max

    async def search_offset(self, topic: str, queue: int, timestamp_ms: int) -> int:
        reply: OffsetReply = await self.links.call_at(topic, queue,
                                                      SearchOffset(topic, queue, timestamp_ms))
        return reply.offset

    async def queue_count(self, topic: str) -> int:
        return await self.links.queue_count(topic)
