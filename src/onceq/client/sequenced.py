"""An idempotent writer: numbered batches the broker stores at most once (Kafka's
idempotent producer; see ``log/sequence.py``).

The caller numbers its messages per queue within an epoch (from 0, without gaps) and
submits batches; up to ``window`` batches are in flight on one connection. A batch that
fails with a retriable error or a lost connection is sent again, with every later batch,
until all are acknowledged or ``timeout`` seconds pass: what the broker already has is
answered as duplicate, so a re-send never stores a message twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..log.record import encode_part
from ..log.sequence import SEQ_PROPERTY, SEQUENCED, check_writer_id, marker
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import SequencedReply
from ..protocol.requests import SendSequenced
from .base import BrokerClient
from .connection import ConnectionLost, retriable
from .security import ClientSecurity

log = logging.getLogger("onceq.client")
_U32 = struct.Struct("<I")

# one message: body, unique key, tags, keys (space separated), properties
Fields = tuple[bytes, str, str, str, dict[str, str] | None]


def encode_sequenced(writer: str, epoch: int, seq: int, messages: Sequence[Fields],
                     born_ms: int) -> bytes:
    """The payload of a sequenced batch: the last message carries its sequence."""
    chunks: list[bytes] = []
    add = chunks.append
    last = len(messages) - 1
    for i, (body, key, tags, keys, props) in enumerate(messages):
        if i == last:
            props = {**(props or {}), SEQ_PROPERTY: marker(writer, epoch, seq + last)}
            part = encode_part(body, key, born_ms, tags, keys, props, SEQUENCED)
        else:
            part = encode_part(body, key, born_ms, tags, keys, props)
        add(_U32.pack(len(part)))
        add(part)
    return b"".join(chunks)


@dataclass(slots=True)
class _Batch:
    request: SendSequenced
    count: int
    fut: asyncio.Future[SequencedReply] | None = field(default=None)


class SequencedWriter(BrokerClient):
    """Sends numbered batches of one writer id and epoch; counts what was stored."""

    def __init__(self, address: str, writer: str, epoch: int, *, window: int = 4,
                 timeout: float = 60.0, security: ClientSecurity | None = None) -> None:
        super().__init__(address, security=security)
        self.writer = check_writer_id(writer)
        self.epoch = epoch
        self.window = max(1, window)
        self.timeout = timeout
        self.stored = 0
        self.duplicates = 0
        self._queued: deque[_Batch] = deque()

    async def queue_count(self, topic: str) -> int:
        """The topic's queue count; a broker out of reach is retried within the timeout."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                return await self.links.queue_count(topic, written=True)
            except OnceqError as exc:
                if not retriable(exc) or time.monotonic() + delay >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def submit(self, topic: str, queue: int, seq: int, messages: Sequence[Fields]
                     ) -> None:
        """Send messages numbered ``seq, seq+1, ...`` on ``queue``; returns once the batch is
        in flight (waits while ``window`` batches are unanswered)."""
        payload = encode_sequenced(self.writer, self.epoch, seq, messages,
                                   int(time.time() * 1000))
        await self.submit_payload(topic, queue, seq, len(messages), payload)

    async def submit_payload(self, topic: str, queue: int, seq: int, count: int,
                             payload: bytes) -> None:
        """``submit`` of a payload encoded already (``encode_sequenced`` or the like)."""
        if count < 1:
            raise ValueError("a sequenced batch must not be empty")
        batch = _Batch(SendSequenced(topic, queue, self.writer, self.epoch, seq, payload),
                       count)
        while len(self._queued) >= self.window:
            await self._settle_oldest()
        await self._send_or_fail(batch)
        self._queued.append(batch)
        await asyncio.sleep(0)  # the request goes out now: the broker stores it meanwhile

    async def flush(self) -> None:
        """Wait until every submitted batch is stored (or raise)."""
        while self._queued:
            await self._settle_oldest()

    async def _send(self, batch: _Batch) -> None:
        req = batch.request  # to its queue's group (a topic spread over groups: routes.py)
        conn = await (await self.links.link(req.topic, req.queue))._connection()
        batch.fut = conn.submit(req)

    async def _send_or_fail(self, batch: _Batch) -> None:
        """Send; a broker out of reach fails the batch's answer instead, which is then
        retried in turn, within the timeout, like any failed answer."""
        try:
            await self._send(batch)
        except OnceqError as exc:
            if not retriable(exc):
                raise
            batch.fut = asyncio.get_running_loop().create_future()
            batch.fut.set_exception(exc)

    async def _settle_oldest(self) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            batch = self._queued[0]
            assert batch.fut is not None
            try:
                reply = await asyncio.wait_for(asyncio.shield(batch.fut),
                                                max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                    f"writer {self.writer}: no answer within {self.timeout}s")) from None
            except OnceqError as exc:
                if not retriable(exc) or time.monotonic() >= deadline:
                    raise
                log.debug("writer %s: batch failed (%s); sending it and the later ones again",
                          self.writer, exc)
                await self._resend_all(exc, delay)
                delay = min(delay * 2, 1.0)
                continue
            self._queued.popleft()
            self.stored += reply.n
            self.duplicates += reply.dup
            return

    async def _resend_all(self, exc: OnceqError, delay: float) -> None:
        """After a failure: wait for the later answers (they fail with OUT_OF_ORDER or
        succeed), then send again, in order, every batch not acknowledged."""
        for b in list(self._queued)[1:]:
            assert b.fut is not None
            with contextlib.suppress(OnceqError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(b.fut), 10.0)
        failed = self._queued[0].request
        if exc.code == ErrorCode.WRONG_GROUP:  # the route moved on: fetched again
            self.links.wrong_group(failed.topic)
        link: BrokerClient = self
        with contextlib.suppress(OnceqError):
            link = await self.links.link(failed.topic, failed.queue)
        # in a group, to the leader from now on (NOT_LEADER, or the broker out of reach)
        if not await link._follow(exc) and isinstance(exc, ConnectionLost) and link._conn:
            link._conn.close()
        await asyncio.sleep(delay)
        kept: deque[_Batch] = deque()
        for b in self._queued:
            assert b.fut is not None
            if b.fut.done() and not b.fut.cancelled() and b.fut.exception() is None:
                kept.append(b)  # acknowledged: counted when it is settled
                continue
            await self._send_or_fail(b)  # not connected yet: settled (and retried) in turn
            kept.append(b)
        self._queued = kept
