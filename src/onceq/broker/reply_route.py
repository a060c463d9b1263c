"""Request-reply on the broker: which connection each reply channel is on, and the routing
of a responder's reply to it (docs/request_reply.md).

A requester names its reply channel (``REPLY_CHANNEL``) on its connection; the channel is
bound to that connection until it closes (a channel another live connection holds is
refused with ``CLIENT_ID_IN_USE``, retriable: a requester that reconnects is served again
once its old connection is seen closed). A responder's ``REPLY`` names the channel and the
request id its request carried: the broker writes the reply to the channel's connection
as a ``REPLY`` push at once (not coalesced with other pushes, not stored) and answers the
responder ``Routed(delivered=True)``. A reply past the request's deadline, or for a channel
no connection has, is dropped and counted (``Routed(False, "late" | "gone")``): replies
are transient, the request itself is an ordinary durable message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..protocol.codes import PushCode
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.frame import PUSH, encode_frame
from ..protocol.replies import Empty, Routed
from ..protocol.requests import ReplyChannel, RouteReply
from ..protocol.schema import Message
from .fields import Call, Handler
from .metrics import Histogram

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .connection import Connection

log = logging.getLogger("onceq.broker")

MAX_CHANNEL = 255  # characters of a reply channel's name at most
MAX_CHANNELS_PER_CONNECTION = 64
# seconds from a request's send to its reply's routing: 1 ms .. 60 s
ROUND_TRIP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0, 30.0, 60.0)


class ReplyRoutes:
    """The reply channels of the connected requesters, and the replies routed to them."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._owner: dict[str, Connection] = {}
        self._channels: dict[Connection, set[str]] = {}
        self.replies = 0  # REPLY requests received
        self.routed = 0
        self.dropped: dict[str, int] = {"late": 0, "gone": 0}
        self.round_trip = Histogram(ROUND_TRIP_BUCKETS)  # request sent -> reply routed

    def handlers(self) -> dict[type[Message], Handler]:
        return {ReplyChannel: self.h_channel, RouteReply: self.h_reply}

    # ---------------------------------------------------------------- channels
    def h_channel(self, call: Call, req: ReplyChannel) -> Empty:
        channel, conn = req.channel, call.conn
        if not channel or len(channel) > MAX_CHANNEL:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                             f"a reply channel is 1 to {MAX_CHANNEL} characters")
        owner = self._owner.get(channel)
        if owner is not None and owner is not conn and not owner.closed:
            raise OnceqError(ErrorCode.CLIENT_ID_IN_USE, f"reply channel {channel!r} belongs "
                             f"to another connection ({owner.peer})")
        mine = self._channels.setdefault(conn, set())
        if channel not in mine and len(mine) >= MAX_CHANNELS_PER_CONNECTION:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"a connection has at most "
                             f"{MAX_CHANNELS_PER_CONNECTION} reply channels")
        if owner is not None and owner is not conn:  # closed, its disconnect not seen yet
            self._channels.get(owner, set()).discard(channel)
        mine.add(channel)
        self._owner[channel] = conn
        return Empty()

    def drop(self, conn: Connection) -> None:
        """``conn`` closed: its channels are free (replies to them are dropped as gone)."""
        for channel in self._channels.pop(conn, ()):
            if self._owner.get(channel) is conn:
                del self._owner[channel]

    @property
    def channels(self) -> int:
        return len(self._owner)

    # ---------------------------------------------------------------- replies
    def h_reply(self, call: Call, req: RouteReply) -> Routed:
        self.replies += 1
        now_ms = int(self.clock() * 1000)
        if req.deadline and now_ms >= req.deadline:
            return self._drop("late", req)
        conn = self._owner.get(req.channel)
        if conn is None or conn.closed:
            return self._drop("gone", req)
        header = {"channel": req.channel, "id": req.id, "body": req.payload}
        try:
            frame = encode_frame(PUSH, PushCode.REPLY, 0, header)
        except (TypeError, ValueError, OverflowError) as exc:  # cannot be: str and bytes
            raise OnceqError(ErrorCode.BAD_REQUEST, f"reply not encodable: {exc}") from None
        # written as the connection writes its answers (batched per loop pass, under its
        # output limits), not as a coalescing push: every reply counts
        conn.write_frame(frame)
        self.routed += 1
        if req.born:
            self.round_trip.observe(max(now_ms - req.born, 0) / 1000)
        return Routed(True)

    def _drop(self, reason: str, req: RouteReply) -> Routed:
        self.dropped[reason] += 1
        log.debug("reply %s to channel %s dropped: %s", req.id, req.channel, reason)
        return Routed(False, reason)

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> Iterator[Metric]:
        """The request-reply families of the broker's ``/metrics``."""
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        c = CounterMetricFamily("onceq_replies", "Replies responders sent to the broker "
                                "(one per request answered).")
        c.add_metric([], self.replies)
        yield c
        c = CounterMetricFamily("onceq_replies_routed", "Replies pushed to their "
                                "requester's connection.")
        c.add_metric([], self.routed)
        yield c
        c = CounterMetricFamily("onceq_replies_dropped", "Replies dropped: past the "
                                "request's deadline (late: the requester timed out), or "
                                "with no connection on the reply channel (gone).",
                                labels=["reason"])
        for reason, n in sorted(self.dropped.items()):
            c.add_metric([reason], n)
        yield c
        g = GaugeMetricFamily("onceq_reply_channels", "Reply channels of connected "
                              "requesters.")
        g.add_metric([], self.channels)
        yield g
        h = HistogramMetricFamily("onceq_request_reply_seconds", "Time from a request's "
                                  "send (the requester's clock) to its reply's routing.")
        h.add_metric([], self.round_trip.buckets(), self.round_trip.sum)
        yield h

    def snapshot(self) -> dict[str, Any]:
        """The counters, for tests and status views."""
        return {"replies": self.replies, "routed": self.routed, **{
            f"dropped_{k}": v for k, v in self.dropped.items()}, "channels": self.channels}
