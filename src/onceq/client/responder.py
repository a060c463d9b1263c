"""The responder's side of request-reply (docs/request_reply.md).

A responder is a push consumer of the requests' topic whose listener answers a request
with ``ctx.reply(message, body)``. Once the listener call acknowledges the message, the
consume service hands the replies to :class:`ReplySender`, which sends each to the broker
(``REPLY``, not awaited by the listener): the broker pushes it to the requester's
connection, or drops it when the request's deadline passed or the requester is gone.
:func:`responder` makes a listener of a function that answers one request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from ..log.record import MessageExt
from ..protocol.replies import Routed
from ..protocol.requests import RouteReply
from .connection import BrokerConnection
from .consume import ConsumeContext, ConsumeStatus
from .request_reply import RequestInfo

__all__ = ["ReplySender", "responder"]

log = logging.getLogger("onceq.consumer")

Handle = Callable[[MessageExt], Awaitable[bytes | str | None] | bytes | str | None]


class ReplySender:
    """Sends the replies of acknowledged requests on the consumer's connection. ``stats``
    (the consumer's) counts ``replies_sent`` (the broker pushed them to their requester),
    ``replies_dropped`` (late, or the requester gone), ``replies_failed`` (the broker did
    not answer: the connection was lost) and ``replies_unsent`` (no connection)."""

    def __init__(self, connection: Callable[[], BrokerConnection | None],
                 stats: Counter[str]) -> None:
        self._connection = connection
        self.stats = stats

    def send(self, done: list[MessageExt], replies: dict[int, bytes]) -> None:
        """Send the reply of each message of ``done`` that has one in ``replies`` (by queue
        offset)."""
        conn = self._connection()
        for m in done:
            body = replies.get(m.queue_offset)
            if body is None:
                continue
            info = RequestInfo.of(m)
            if info is None:
                continue
            if conn is None or conn.closed:
                self.stats["replies_unsent"] += 1
                continue
            fut = conn.submit(RouteReply(info.channel, info.request_id, m.topic,
                                         info.deadline_ms, info.born_ms, body))
            fut.add_done_callback(self._routed)

    def _routed(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.stats["replies_failed"] += 1
            log.debug("reply not routed: %s", exc)
            return
        routed: Routed = fut.result()
        self.stats["replies_sent" if routed.delivered else "replies_dropped"] += 1
        if not routed.delivered:
            self.stats[f"replies_dropped_{routed.reason}"] += 1


def responder(handle: Handle) -> Callable[[list[MessageExt], ConsumeContext],
                                         Awaitable[ConsumeStatus | None]]:
    """A listener answering each request with ``handle(message)`` (bytes or str; None: no
    reply). An async ``handle`` runs on the event loop, a plain one on a thread. A message
    whose ``handle`` raises is retried with the rest of its batch (the messages before it
    are acknowledged and answered)."""
    is_async = inspect.iscoroutinefunction(handle) or inspect.iscoroutinefunction(
        type(handle).__call__)

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeStatus | None:
        for i, m in enumerate(msgs):
            try:
                if is_async:
                    body = await handle(m)  # type: ignore[misc]
                else:
                    body = await asyncio.to_thread(handle, m)
            except Exception:
                log.exception("responder failed on %s@%d; retried", m.topic, m.queue_offset)
                ctx.ack_index = i - 1
                return ConsumeStatus.SUCCESS  # the messages before it are done
            if body is not None and RequestInfo.of(m) is not None:
                ctx.reply(m, body)
        return None

    return listener
