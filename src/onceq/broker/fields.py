"""What the services share at the request boundary: ``Call`` (one request being answered),
the shape of a handler, batch payloads and the topic-name rules of client requests.

Requests reach the services decoded and checked (``protocol/requests.py``): a handler
takes the ``Call`` and its typed request and returns its typed reply, or None when it
answers later itself (``Call.answer``), e.g. once a write is durable or a held pull wakes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.codes import SYSTEM_PREFIX
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.schema import Message

if TYPE_CHECKING:
    from .connection import Connection

_U32 = struct.Struct("<I")


class Call:
    """One request being answered: the connection it came on and its correlation id. A
    second front end gives the services its own ``Call`` (``conn`` is what the member
    registry and the held pulls keep: pushes go to it)."""

    __slots__ = ("conn", "corr")

    def __init__(self, conn: Connection, corr: int) -> None:
        self.conn = conn
        self.corr = corr

    def answer(self, reply: Message) -> None:
        self.conn.answer(self.corr, reply)

    def fail(self, exc: OnceqError) -> None:
        self.conn.respond(self.corr, int(exc.code), {**exc.details, "message": exc.message})


# a handler: the typed request in, its typed reply out (None: it answers later itself)
Handler = Callable[[Call, Any], Message | None]


def split_parts(payload: bytes) -> list[memoryview]:
    """Split a batch payload of [u32 length][part] items."""
    view = memoryview(payload)
    parts = []
    pos = 0
    n = len(view)
    while pos < n:
        if n - pos < 4:
            raise OnceqError(ErrorCode.BAD_REQUEST, "truncated message length in batch")
        size = _U32.unpack_from(view, pos)[0]
        pos += 4
        if size > n - pos:
            raise OnceqError(ErrorCode.BAD_REQUEST, "message length exceeds the batch")
        parts.append(view[pos:pos + size])
        pos += size
    if not parts:
        raise OnceqError(ErrorCode.BAD_REQUEST, "empty batch")
    return parts


def user_topic(topic: str) -> str:
    """Refuse the broker's internal offsets journal topic in user requests."""
    if topic == OFFSETS_TOPIC:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         f"topic {OFFSETS_TOPIC} is internal to the broker (the consumer "
                         "offsets journal): it cannot be sent to, pulled, created or deleted")
    return topic


def is_system_topic(topic: str) -> bool:
    """Whether ``topic`` is one the broker keeps for itself: ``%RETRY%<group>``,
    ``%DLQ%<group>``, ``%SCHEDULE%``, ``%TRACE%``, ``%OFFSETS%`` (every name that starts
    with ``%``)."""
    return topic.startswith(SYSTEM_PREFIX)


def client_written_topic(topic: str) -> str:
    """Refuse a system topic as the target of a client's send, topic creation or deletion.

    The broker alone writes them: the schedule service trusts the due time and the target
    of every ``%SCHEDULE%`` record, the audit every ``%TRACE%`` record, the offsets replay
    every ``%OFFSETS%`` record, and a group's retry topic is consumed by all its members.
    A consumer's send-back and ``onceq dlq resend`` go through ``CONSUMER_SEND_BACK``, which
    copies a stored message (``retry.py``). Pulls of system topics stay allowed."""
    user_topic(topic)
    if is_system_topic(topic):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         f"topic {topic!r} is a system topic (names starting with "
                         f"{SYSTEM_PREFIX!r}): only the broker writes, creates and deletes it; "
                         "failed messages go back through CONSUMER_SEND_BACK")
    return topic
