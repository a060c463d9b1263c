"""Producer: send with retries inside a time budget, batch send, fire-and-forget."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..log.batch import COMPRESSIONS, MAX_BATCH_COUNT, encode_batch, encode_bodies_batch
from ..log.delay import deliver_ms_of
from ..log.record import encode_part
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import SendReply, TopicInfo
from ..protocol.requests import GetTopic, Send, SendBatch, SendRecords
from .base import BrokerClient, Connect
from .connection import BrokerConnection, ConnectionLost, call
from .message import Message, SendResult, UniqueKeyGenerator, as_message, encode_message
from .queue_health import QueueHealth
from .request_client import RequestChannel
from .request_reply import Reply
from .security import ClientSecurity

log = logging.getLogger("onceq.client")
_U32 = struct.Struct("<I")
_REFRESH_ON = (ErrorCode.TOPIC_NOT_EXIST, ErrorCode.INVALID_QUEUE)
_ELSEWHERE = (ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_MOVING)  # sent to another queue
RETRY_BACKOFF_S = 0.05  # the first wait after a retriable broker code, doubled each time
QUEUE_REFRESH_S = 5.0  # a topic's write queue count is fetched again this often

# (number of queues of the topic, the message) -> queue id; for ordered messages
QueueSelector = Callable[[int, Message], int]


class Producer(BrokerClient):
    """Async producer.

    ``retries`` is the number of extra attempts after a failure (3 attempts in all by
    default), all within ``send_timeout`` seconds. A retry after a transport error or a
    retriable broker code goes to the next queue unless the queue is pinned (sharding key
    or explicit queue). After a retriable broker code (a full disk, a busy broker) the
    next attempt waits 50 ms, then 100 ms, ... (at most half the time left); after a lost
    connection it goes at once. A retry carries the same unique key, so the broker's dedup window
    stores a message at most once and answers the retry with the first result.

    ``address`` may be a broker group's bootstrap list (``"h1:p1,h2:p2,h3:p3"``): the
    producer sends to the group's leader; after ``NOT_LEADER`` or a lost connection it
    finds the new leader and sends again there (``base.py``) with the same unique keys,
    until ``send_timeout`` (these attempts do not count against ``retries``): the new
    leader answers a retry of a send it already has as a duplicate. Give a failover
    room: a ``send_timeout`` above the group's election time (the session TTL and a
    second).

    Ordering: messages sent one after the other (each send awaited) with the same sharding
    key, or to the queue the same ``selector`` picks, go to one queue and are stored in
    send order; an orderly consumer (see ``consume_orderly.py``) then handles them in that
    order. A selector is called with the topic's queue count and the message (the first
    one of a batch) and returns a queue id in ``range(count)``; it must be deterministic
    for a key. Sends not awaited one after the other (concurrent tasks, ``send_oneway``
    racing a retry) have no defined order; nor do messages of one key while the topic's
    queue count changes.

    A queue whose sends fail (its fuse is tripped: ``QUEUE_FULL``; the broker is busy or
    its write failed) is avoided by unkeyed sends for a back-off (``queue_health.py``,
    ``health``); a ``QUEUE_FULL`` moves an unkeyed send to another queue at once, not
    counted against ``retries``, while a keyed (pinned) send waits and tries its queue
    again within ``send_timeout``: a key is never reordered.

    ``send_batch`` of two or more messages sends them as one record batch, which the
    broker stores as it is sent; ``compression`` ("zstd" or "lz4", with the
    ``compression`` extra installed here and on the broker) compresses its messages as one
    frame, stored and delivered compressed.
    """

    def __init__(self, address: str = "127.0.0.1:9876", *, retries: int = 2,
                 send_timeout: float = 3.0, connect: Connect | None = None,
                 security: ClientSecurity | None = None, compression: str = "none") -> None:
        super().__init__(address, connect, security)
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}")
        self.compression = compression  # of a batch's parts (the ``compression`` extra)
        self._records = True  # False once the broker says it takes no record batch
        self.retries = retries
        self.send_timeout = send_timeout
        self._queues: dict[str, int] = {}
        self._queues_until: dict[str, float] = {}  # when each topic's count is fetched again
        self.queue_refresh_s = QUEUE_REFRESH_S
        self._rr: dict[str, int] = {}
        self._keys = UniqueKeyGenerator()
        self.health = QueueHealth()  # queues unkeyed sends avoid for a while
        # request-reply: the reply channel and the requests waiting (request_client.py)
        self.requests = RequestChannel(self.send, self._connection)

    async def queue_count(self, topic: str, refresh: bool = False) -> int:
        n = self._queues.get(topic)
        if n is None or refresh or time.monotonic() >= self._queues_until[topic]:
            route = await self.links.route(topic)  # spread over groups: its placement
            if route is not None:
                return len(route.placement)
            info: TopicInfo = await self._call(GetTopic(topic))
            n = self._queues[topic] = info.write_queues or info.queues  # the written ones
            self._queues_until[topic] = time.monotonic() + self.queue_refresh_s
        return n

    def _pick_queue(self, topic: str, n: int, sharding_key: str | None, queue: int | None,
                    selector: QueueSelector | None = None, first: Any = None,
                    among: list[int] | None = None) -> int:
        if queue is not None:
            return queue
        if selector is not None:
            qid = selector(n, as_message(first))
            if not isinstance(qid, int) or isinstance(qid, bool) or not 0 <= qid < n:
                raise ValueError(f"selector returned {qid!r}: topic {topic!r} has queues "
                                 f"0..{n - 1}")
            return qid
        if sharding_key is not None:
            return zlib.crc32(sharding_key.encode()) % n
        i = self._rr.get(topic, -1) + 1
        self._rr[topic] = i
        return self.health.pick(topic, n, i, among)

    async def send(self, topic: str, message: Message | bytes | str, *,
                   sharding_key: str | None = None, queue: int | None = None,
                   selector: QueueSelector | None = None, deliver_at: float | None = None,
                   delay_s: float | None = None) -> SendResult:
        """Send one message and wait for the broker's acknowledgement. The queue: ``queue``
        if given, else the one ``selector`` picks, else the hash of ``sharding_key``, else
        round-robin.

        A delayed message (``deliver_at``: seconds since the epoch, as ``time.time()``; or
        ``delay_s``: seconds from now) is stored at once and delivered to its queue at that
        time, within a second (docs/delayed.md); its result's offset is -1."""
        if deliver_at is not None or delay_s is not None:
            message = replace(as_message(message), deliver_at_ms=deliver_ms_of(
                deliver_at, delay_s, time.time()))
        results = await self.send_batch(topic, [message], sharding_key=sharding_key,
                                        queue=queue, selector=selector)
        return results[0]

    async def send_batch(self, topic: str, messages: Sequence[Message | bytes | str], *,
                         sharding_key: str | None = None, queue: int | None = None,
                         selector: QueueSelector | None = None) -> list[SendResult]:
        """Send messages to one queue in one request; one result per message."""
        if not messages:
            return []
        kind, payload, keys = self._encode(messages)
        pinned = sharding_key is not None or queue is not None or selector is not None
        deadline = time.monotonic() + self.send_timeout
        attempt = full = 0
        qid: int | None = None
        n = 0
        link: BrokerClient = self
        while True:
            attempt += 1
            try:
                n = await self.queue_count(topic, refresh=attempt > 1 and not pinned)
                if qid is None or not pinned:
                    among = None if pinned else await self.links.key_queues(topic, keys[0])
                    qid = self._pick_queue(topic, n, sharding_key, queue, selector,
                                           messages[0], among)
                link = await self.links.link(topic, qid)  # its group's (routes.py)
                conn = await link._connection()
                wait = link._attempt_wait(deadline, self.send_timeout)
                started = time.monotonic()
                reply = await call(conn, kind(topic, qid, payload), wait)
                self.health.succeeded(topic, qid, time.monotonic() - started)
                return _results(topic, reply, keys)
            except OnceqError as exc:
                if kind is SendRecords and exc.code == ErrorCode.UNKNOWN_REQUEST:
                    # a broker older than record batches: SEND_BATCH from now on, with
                    # the same unique keys (nothing was stored)
                    log.info("the broker at %s takes no record batch: sending SEND_BATCH",
                             self.address)
                    self._records = False
                    kind, payload, keys = self._encode(messages, keys)
                    attempt -= 1
                    continue
                if qid is not None:
                    self.health.failed(topic, qid, exc.code)
                retriable = exc.retriable or (exc.code in _REFRESH_ON and not pinned)
                if not retriable or time.monotonic() >= deadline:
                    raise
                log.debug("send attempt %d to %s failed: %s; retrying", attempt, topic, exc)
                if exc.code == ErrorCode.TOPIC_NOT_EXIST:
                    self.links.forget(topic)  # the route moved on: fetched again
                if exc.code == ErrorCode.WRONG_GROUP:
                    self.links.wrong_group(topic)
                    attempt -= 1
                    continue
                # the queue's fuse, or the queue moving to another group: not counted
                # against retries; unkeyed, to a healthy queue at once; keyed (or none
                # healthy), wait
                if exc.code in _ELSEWHERE:
                    attempt -= 1
                    if pinned or self.health.all_unhealthy(topic, n):
                        full += 1
                        await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** full, 1.0,
                                                max(deadline - time.monotonic(), 0) / 2))
                    continue
                if await link._follow(exc):  # a group: to its leader, within send_timeout
                    continue
                if attempt > self.retries:
                    raise
                if isinstance(exc, ConnectionLost):
                    if link._conn is not None:
                        link._conn.close()
                elif exc.retriable:  # a broker under pressure (disk full, busy): back off
                    await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (attempt - 1),
                                            max(deadline - time.monotonic(), 0) / 2))

    def _encode(self, messages: Sequence[Message | bytes | str],
                keys: list[str] | None = None) -> tuple[type[Send], bytes, list[str]]:
        """The request type and payload of a send of ``messages``, and their unique keys
        (new ones unless given): ``SEND`` of one message, else one record batch
        (``SEND_RECORDS``), stored as it is sent (``SEND_BATCH`` to an older broker)."""
        now_ms = int(time.time() * 1000)
        n = len(messages)
        if n > MAX_BATCH_COUNT:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"a send holds at most "
                             f"{MAX_BATCH_COUNT} messages (got {n}): send them in several "
                             "batches")
        if n > 1 and any(isinstance(m, Message) and m.deliver_at_ms for m in messages):
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, "a delayed message is sent alone "
                             "(send), not in a batch")
        keys = self._keys.many(n) if keys is None else list(keys)
        if n > 1 and self._records and all(type(m) is bytes for m in messages):
            return SendRecords, encode_bodies_batch(messages, keys, now_ms,  # type: ignore[arg-type]
                                                    self.compression), keys
        parts: list[bytes] = []
        add = parts.append
        for i, m in enumerate(messages):
            if type(m) is bytes:
                add(encode_part(m, keys[i], now_ms))
            else:
                msg = as_message(m)
                if msg.unique_key:
                    keys[i] = msg.unique_key
                add(encode_message(msg, keys[i], now_ms))
        if n == 1 or not self._records:
            return (Send if n == 1 else SendBatch), b"".join(
                b"".join((_U32.pack(len(p)), p)) for p in parts), keys
        return SendRecords, encode_batch(parts, self.compression), keys

    async def request(self, topic: str, message: Message | bytes | str, timeout: float = 3.0,
                      *, sharding_key: str | None = None, queue: int | None = None,
                      selector: QueueSelector | None = None) -> Reply:
        """Send ``message`` as a request and return its reply (docs/request_reply.md). The
        request is an ordinary durable message (sent like ``send``, to the queue chosen the
        same way) carrying this producer's reply channel, a request id and its deadline; a
        responder answers it with ``ctx.reply``. ``RequestTimeout`` (``REQUEST_TIMEOUT``)
        when no reply comes within ``timeout`` seconds: the request may still be carried
        out. Counters and round-trip percentiles: ``requests.stats``."""
        return await self.requests.request(topic, message, timeout, sharding_key=sharding_key,
                                           queue=queue, selector=selector)

    def _on_push(self, code: int, header: dict[str, Any]) -> None:
        self.requests.on_push(code, header)

    async def _on_connected(self, conn: BrokerConnection) -> None:
        await self.requests.on_connected(conn)

    async def send_oneway(self, topic: str, message: Message | bytes | str, *,
                          sharding_key: str | None = None, queue: int | None = None,
                          selector: QueueSelector | None = None) -> None:
        """Fire-and-forget: write the message and do not wait for any reply."""
        _kind, payload, _keys = self._encode([message])
        n = await self.queue_count(topic)
        qid = self._pick_queue(topic, n, sharding_key, queue, selector, message)
        conn = await self._connection()
        conn.call_oneway(Send(topic, qid, payload))


def _results(topic: str, reply: SendReply, keys: list[str]) -> list[SendResult]:
    queue = reply.queue
    if not reply.dups:  # every message stored anew (the common case)
        return [SendResult(topic, queue, off, k)
                for off, k in zip(reply.offsets, keys, strict=True)]
    dup_queue = dict(zip(reply.dups, reply.dupq, strict=True))  # a duplicate's first copy
    return [SendResult(topic, dup_queue.get(i, queue), off, k, i in dup_queue)
            for i, (off, k) in enumerate(zip(reply.offsets, keys, strict=True))]
