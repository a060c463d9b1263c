"""Consumer-offset commits as commit-log records (pure functions, no I/O).

A commit is stored as an ordinary message of the internal topic ``%OFFSETS%`` (one queue,
no unique key, so no dedup window): the commit log's CRC, group-commit fsync, tail recovery
and damage handling apply to offsets as to messages. The message body is::

    u8  format version (1)
    u8  group length      group bytes (ascii)
    u8  topic length      topic bytes (ascii)
    u32 queue id
    i64 committed offset (next offset to consume, >= 0)

A consumer group deleted (``DELETE_GROUP``: every offset of the group forgotten; a later
commit starts it again) is a record of its own::

    u8  2
    u8  group length      group bytes (ascii)

The offsets snapshot (``offsets.json``) records up to which offset of ``%OFFSETS%`` it
covers: ``{"format": 2, "covered": N, "groups": {group: {topic: {queue: offset}}}}``. The
first format (only the groups map) is read as covering nothing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from .record import encode_part

OFFSETS_TOPIC = "%OFFSETS%"
VERSION = 1
GROUP_DELETED = 2  # the first byte of a group deletion
SNAPSHOT_FORMAT = 2
_TAIL = struct.Struct("<Iq")
_MAX_NAME = 255

Offsets = dict[str, dict[str, dict[str, int]]]


class OffsetRecordError(ValueError):
    """A body that is not an offset commit of a known format."""


@dataclass(frozen=True, slots=True)
class OffsetCommit:
    group: str
    topic: str
    queue_id: int
    offset: int


def encode_commit(c: OffsetCommit) -> bytes:
    """The message body of one offset commit."""
    g, t = c.group.encode("ascii"), c.topic.encode("ascii")
    if not 0 < len(g) <= _MAX_NAME or not 0 < len(t) <= _MAX_NAME:
        raise OffsetRecordError("group and topic must be 1-255 ascii characters")
    if not 0 <= c.queue_id < 2 ** 32 or not 0 <= c.offset < 2 ** 63:
        raise OffsetRecordError("queue or offset out of range")
    return b"".join((bytes((VERSION, len(g))), g, bytes((len(t),)), t,
                     _TAIL.pack(c.queue_id, c.offset)))


def decode_commit(body: bytes) -> OffsetCommit:
    """Inverse of :func:`encode_commit`; raises OffsetRecordError on anything else."""
    try:
        if body[0] != VERSION:
            raise OffsetRecordError(f"unknown offset record version {body[0]}")
        p = 2 + body[1]
        group = body[2:p].decode("ascii")
        q = p + 1 + body[p]
        topic = body[p + 1:q].decode("ascii")
        if not group or not topic or len(body) != q + _TAIL.size:
            raise OffsetRecordError("malformed offset record")
        queue_id, offset = _TAIL.unpack_from(body, q)
    except (IndexError, UnicodeDecodeError, struct.error):
        raise OffsetRecordError("malformed offset record") from None
    if offset < 0:
        raise OffsetRecordError("negative offset in offset record")
    return OffsetCommit(group, topic, queue_id, offset)


@dataclass(frozen=True, slots=True)
class GroupDeleted:
    group: str


def encode_group_deleted(d: GroupDeleted) -> bytes:
    """The message body of one group deletion."""
    g = d.group.encode("ascii")
    if not 0 < len(g) <= _MAX_NAME:
        raise OffsetRecordError("a group must be 1-255 ascii characters")
    return bytes((GROUP_DELETED, len(g))) + g


def decode_offset_record(body: bytes) -> OffsetCommit | GroupDeleted:
    """A record of ``%OFFSETS%``: a commit or a group deletion; raises OffsetRecordError
    on anything else."""
    if body[:1] != bytes((GROUP_DELETED,)):
        return decode_commit(body)
    try:
        group = body[2:2 + body[1]].decode("ascii")
    except (IndexError, UnicodeDecodeError):
        raise OffsetRecordError("malformed group deletion record") from None
    if not group or len(body) != 2 + body[1]:
        raise OffsetRecordError("malformed group deletion record")
    return GroupDeleted(group)


def commit_part(c: OffsetCommit | GroupDeleted, now_ms: int) -> bytes:
    """The message part stored in ``%OFFSETS%`` for one commit or group deletion (no
    unique key: no dedup)."""
    body = encode_commit(c) if isinstance(c, OffsetCommit) else encode_group_deleted(c)
    return encode_part(body, "", now_ms)


def encode_snapshot(groups: Offsets, covered: int) -> bytes:
    """``offsets.json``: the offsets after applying every commit record below ``covered``."""
    return json.dumps({"format": SNAPSHOT_FORMAT, "covered": covered, "groups": groups},
                      indent=1, sort_keys=True).encode()


def decode_snapshot(raw: Any) -> tuple[Offsets, int]:
    """(groups, covered) from the parsed JSON of ``offsets.json`` (either format)."""
    if not isinstance(raw, dict):
        raise ValueError("offsets snapshot is not a map")
    if isinstance(raw.get("format"), int):  # a group's value is a map, never an int
        if raw["format"] != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown offsets snapshot format {raw['format']}")
        groups, covered = raw.get("groups", {}), raw.get("covered", 0)
    else:
        groups, covered = raw, 0
    if not _count(covered) or not isinstance(groups, dict):
        raise ValueError("malformed offsets snapshot (covered records or groups)")
    for g, topics in groups.items():
        if not isinstance(topics, dict):
            raise ValueError(f"malformed offsets snapshot: group {g!r} is not a map")
        for t, qs in topics.items():
            if not isinstance(qs, dict):
                raise ValueError(f"malformed offsets snapshot: {g!r}/{t!r} is not a map")
            for q, o in qs.items():
                if not (q.isdigit() and q.isascii()) or not _count(o):
                    raise ValueError(f"malformed offsets snapshot: {g!r}/{t!r} queue {q!r} "
                                     f"offset {o!r}")
    return groups, covered


def _count(value: Any) -> bool:
    """An integer >= 0 (JSON ``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
