"""Request header fields as the handlers read them, and the shape of a handler's answer.

Each handler reads its header's fields once, through these checks, which turn a missing
or mistyped field into ``INVALID_ARGUMENT`` (a malformed batch into ``BAD_REQUEST``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..log.offset_record import OFFSETS_TOPIC
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


def int_field(header: dict[str, Any], name: str, default: int | None = None) -> int:
    value = header.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be an integer")
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
