"""Request header fields as the handlers read them, and the shape of a handler's answer.

Each handler reads its header's fields once, through these checks, which turn a missing
or mistyped field into ``INVALID_ARGUMENT`` (a malformed batch into ``BAD_REQUEST``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
from ..protocol.codes import SYSTEM_PREFIX
from ..protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from .connection import Connection

_U32 = struct.Struct("<I")

# (code, header, payload) to answer now; None when the handler answers later itself
Response = tuple[int, dict[str, Any] | None, bytes] | None
Handler = Callable[["Connection", int, dict[str, Any], bytes], Response]


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


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def is_int64(value: object) -> bool:
    """An integer (not a bool) that fits the wire's and the store's signed 64 bits."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and INT64_MIN <= value <= INT64_MAX)


def int_field(header: dict[str, Any], name: str, default: int | None = None) -> int:
    """An integer field, checked against 64 bits here, where it is read: nothing out of
    range reaches the store or a reply."""
    value = header.get(name, default)
    if type(value) is not int:  # decoded headers hold plain ints (a bool is not one)
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be an integer")
    if not INT64_MIN <= value <= INT64_MAX:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT,
                         f"field {name!r} is out of range (a signed 64-bit integer)")
    return value


def str_field(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be a string")
    return value


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
