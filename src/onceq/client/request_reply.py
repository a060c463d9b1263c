"""Request-reply on the client: what a request carries, and the requester's table of the
requests waiting for their reply (docs/request_reply.md).

A request is an ordinary message with three properties: ``REPLY_TO``, the requester's
reply channel (unique per requester; the broker binds it to the requester's connection),
``REQUEST_ID``, the request's id on that channel (what the reply is matched by), and
``REQUEST_DEADLINE_MS``, when the requester stops waiting (ms since the epoch, the
requester's clock). :class:`PendingRequests` matches replies to waiting requests; a reply
nobody waits for (the request timed out or was given up, or its reply came already) is
dropped and counted. Pure: no I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..log.record import MessageExt
from ..protocol.errors import ErrorCode, OnceqError

__all__ = ["PROP_DEADLINE", "PROP_REPLY_TO", "PROP_REQUEST_ID", "PendingRequests", "Reply",
           "RequestInfo", "RequestTimeout", "new_channel", "request_properties"]

PROP_REPLY_TO = "REPLY_TO"
PROP_REQUEST_ID = "REQUEST_ID"
PROP_DEADLINE = "REQUEST_DEADLINE_MS"
# latencies kept for the percentiles of ``PendingRequests.latency`` (the latest ones)
LATENCY_SAMPLES = 4096


def new_channel() -> str:
    """A reply channel name: the host, the process and random bits (unique per requester,
    and not to be guessed by another client)."""
    return f"{socket.gethostname()[:64]}@{os.getpid()}@{os.urandom(6).hex()}"


def request_properties(base: Mapping[str, str], channel: str, request_id: str,
                       deadline_ms: int) -> dict[str, str]:
    """The properties of a request: the message's own and the three of request-reply."""
    return {**base, PROP_REPLY_TO: channel, PROP_REQUEST_ID: request_id,
            PROP_DEADLINE: str(deadline_ms)}


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """The request-reply properties of a consumed message."""

    channel: str
    request_id: str
    deadline_ms: int  # 0: none given
    born_ms: int  # when the request was sent (its store timestamp's source)

    @classmethod
    def of(cls, msg: MessageExt) -> RequestInfo | None:
        """The request ``msg`` is, or None when it is no request (it has no reply channel
        or no request id)."""
        props = msg.properties
        channel = props.get(PROP_REPLY_TO)
        rid = props.get(PROP_REQUEST_ID)
        if not channel or not rid:
            return None
        try:
            deadline = int(props.get(PROP_DEADLINE, "0"))
        except ValueError:
            deadline = 0
        return cls(channel, rid, max(deadline, 0), msg.born_ts_ms)

    def expired(self, now_ms: int) -> bool:
        """Whether the requester has stopped waiting (its deadline passed)."""
        return bool(self.deadline_ms) and now_ms >= self.deadline_ms


def is_request(msg: MessageExt) -> bool:
    return RequestInfo.of(msg) is not None


class RequestTimeout(OnceqError):
    """No reply within the request's timeout (``REQUEST_TIMEOUT``). The request was sent and
    stored: it may still be carried out, and its reply is then dropped."""

    def __init__(self, request_id: str, topic: str, timeout: float) -> None:
        super().__init__(ErrorCode.REQUEST_TIMEOUT, f"no reply to request {request_id} on "
                         f"{topic} within {timeout:g}s (it may still be carried out)")
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class Reply:
    """A request's reply: its ``body``, the request's id and where the request was stored
    (``topic``, ``queue_id``, ``offset``, its ``unique_key``), and the round trip."""

    body: bytes
    request_id: str
    topic: str
    queue_id: int
    offset: int
    unique_key: str
    elapsed_s: float


@dataclass(slots=True)
class _Waiting:
    future: asyncio.Future[bytes]
    started: float  # loop time


@dataclass
class PendingRequests:
    """The requests waiting for their reply, by request id; ``stats`` counts ``requests``,
    ``replies`` (matched), ``timeouts``, ``given_up`` (cancelled by the caller),
    ``late_replies`` (dropped: nobody waits for them) and ``failed`` (the send failed)."""

    stats: Counter[str] = field(default_factory=Counter)
    _waiting: dict[str, _Waiting] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _latencies: list[float] = field(default_factory=list)
    _next_sample: int = 0

    def new_id(self) -> str:
        """A request id, unique on this table's reply channel."""
        return format(next(self._ids), "x")

    def add(self, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future[bytes]:
        """Wait for the reply of ``request_id``: its future (the reply's body)."""
        fut: asyncio.Future[bytes] = loop.create_future()
        self._waiting[request_id] = _Waiting(fut, loop.time())
        self.stats["requests"] += 1
        return fut

    def resolve(self, request_id: str, body: bytes, now: float) -> bool:
        """The reply of ``request_id`` came at loop time ``now``: True when a request
        waited for it; else it is dropped (late, or a second reply) and counted."""
        w = self._waiting.pop(request_id, None)
        if w is None or w.future.done():
            self.stats["late_replies"] += 1
            return False
        w.future.set_result(body)
        self.stats["replies"] += 1
        self._sample(now - w.started)
        return True

    def finish(self, request_id: str, outcome: str) -> None:
        """Stop waiting for ``request_id`` (``outcome``: ``timeouts``, ``given_up`` or
        ``failed``, the counter it adds to); a reply that comes later is dropped."""
        w = self._waiting.pop(request_id, None)
        if w is not None:
            self.stats[outcome] += 1
            if not w.future.done():
                w.future.cancel()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _sample(self, seconds: float) -> None:
        if len(self._latencies) < LATENCY_SAMPLES:
            self._latencies.append(seconds)
        else:  # the oldest sample goes
            self._latencies[self._next_sample] = seconds
            self._next_sample = (self._next_sample + 1) % LATENCY_SAMPLES

    def latency(self, quantile: float) -> float | None:
        """The ``quantile`` (0..1) of the latest round trips in seconds (None: none yet)."""
        if not self._latencies:
            return None
        ordered = sorted(self._latencies)
        return ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]
