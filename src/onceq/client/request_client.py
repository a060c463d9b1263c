"""The requester's side of request-reply: ``Producer.request`` (docs/request_reply.md).

A producer that makes a request names its reply channel on its connection first
(``REPLY_CHANNEL``; again on every new connection from then on), sends the request as an
ordinary message through its normal send path (retries keep the unique key, so the broker
stores it once) and waits for the reply the broker pushes to that connection (``REPLY``),
matched by request id in a :class:`~onceq.client.request_reply.PendingRequests` table.
When the connection is lost while a request waits, it reconnects and names the channel
again, so a reply routed after that still arrives. No reply within the timeout:
``RequestTimeout`` (``REQUEST_TIMEOUT``); a reply that comes later is dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..protocol.codes import PushCode
from ..protocol.errors import OnceqError
from ..protocol.requests import ReplyChannel
from .connection import BrokerConnection, call
from .message import Message, SendResult, as_message
from .request_reply import (
    PendingRequests,
    Reply,
    RequestTimeout,
    new_channel,
    request_properties,
)

log = logging.getLogger("onceq.client")

COUNTERS = ("requests", "replies", "timeouts", "given_up", "failed", "late_replies")
RECONNECT_WAIT_S = 0.05  # between two tries to reach the broker again while a request waits

Send = Callable[..., Awaitable[SendResult]]
Connection = Callable[[], Awaitable[BrokerConnection]]


class RequestChannel:
    """One producer's reply channel and its requests waiting for their reply. ``pending``
    holds the counters (``pending.stats``) and the round-trip percentiles."""

    def __init__(self, send: Send, connection: Connection) -> None:
        self._send = send
        self._connection = connection
        self.channel = new_channel()
        self.pending = PendingRequests()
        self._active = False  # a request was made: every new connection names the channel
        self._named_on: BrokerConnection | None = None

    @property
    def stats(self) -> dict[str, Any]:
        """The counters, the requests waiting and the round trip's p50/p99 (seconds)."""
        p = self.pending
        counts = {k: p.stats[k] for k in COUNTERS}
        return {**counts, "waiting": p.waiting, "p50_s": p.latency(0.5),
                "p99_s": p.latency(0.99)}

    async def request(self, topic: str, message: Message | bytes | str, timeout: float,
                      **send_options: Any) -> Reply:
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        conn = await self._named(deadline)
        msg = as_message(message)
        rid = self.pending.new_id()
        # the broker's deadline is the requester's (what connecting took is not added)
        props = request_properties(msg.properties, self.channel, rid,
                                   int((time.time() + deadline - loop.time()) * 1000))
        fut = self.pending.add(rid, loop)
        outcome = "failed"
        try:
            sent = await self._send(topic, Message(msg.body, msg.tags, msg.keys, props,
                                                   msg.unique_key), **send_options)
            lost: asyncio.Future[None] | None = conn.lost
            while not fut.done():
                left = deadline - loop.time()
                if left <= 0:
                    outcome = "timeouts"
                    raise RequestTimeout(rid, topic, timeout)
                await asyncio.wait([fut] if lost is None else [fut, lost], timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not fut.done() and lost is not None and lost.done():
                    # the reply comes on a new connection, with the channel named on it
                    new = await self._reconnect(deadline)
                    lost = None if new is None else new.lost
            body = fut.result()
        except asyncio.CancelledError:
            if not fut.done():
                outcome = "given_up"
            raise
        finally:
            if not fut.done() or fut.cancelled():
                self.pending.finish(rid, outcome)
        return Reply(body, rid, sent.topic, sent.queue_id, sent.offset, sent.unique_key,
                     loop.time() - started)

    async def _named(self, deadline: float) -> BrokerConnection:
        """The producer's connection, with the reply channel named on it (tried again
        while the broker still sees the channel's previous connection, until
        ``deadline``)."""
        self._active = True
        loop = asyncio.get_running_loop()
        while True:
            conn = await self._connection()
            if self._named_on is conn and not conn.closed:
                return conn
            try:
                await call(conn, ReplyChannel(self.channel))
                self._named_on = conn
                return conn
            except OnceqError as exc:
                if not exc.retriable or loop.time() + RECONNECT_WAIT_S >= deadline:
                    raise
            await asyncio.sleep(RECONNECT_WAIT_S)

    async def _reconnect(self, deadline: float) -> BrokerConnection | None:
        """A new connection with the channel named on it, tried until ``deadline`` (None:
        none by then)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await self._named(deadline)
            except OnceqError as exc:
                if loop.time() + RECONNECT_WAIT_S >= deadline:
                    log.debug("reply channel %s: no connection before the deadline: %s",
                              self.channel, exc)
                    return None
            await asyncio.sleep(RECONNECT_WAIT_S)

    # ---------------------------------------------------------------- connection events
    async def on_connected(self, conn: BrokerConnection) -> None:
        """A new connection of the producer: name the channel on it once requests were
        made (a failure is left to the next request, which names it again)."""
        if not self._active:
            return
        try:
            await call(conn, ReplyChannel(self.channel))
            self._named_on = conn
        except OnceqError as exc:
            log.debug("reply channel %s not named on the new connection: %s",
                      self.channel, exc)

    def on_push(self, code: int, header: dict[str, Any]) -> bool:
        """A server push: True when it was a reply (matched, or dropped as late)."""
        if code != PushCode.REPLY:
            return False
        rid, body = header.get("id"), header.get("body")
        if header.get("channel") != self.channel or not isinstance(rid, str) \
                or not isinstance(body, bytes):
            log.warning("reply push not for this channel or malformed: dropped")
            return True
        self.pending.resolve(rid, body, asyncio.get_running_loop().time())
        return True

