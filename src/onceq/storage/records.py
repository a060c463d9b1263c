"""Reading the commit-log records that index entries point at.

An index entry promises a record (its size, queue, offset, position and topic); these
functions read the log bytes it points at and say whether they are that record. Reads,
repairs, the put path's duplicate check and the recovery all go through them.
"""

from __future__ import annotations

from ..log.record import RecordError, RecordHead, check_record, record_matches
from ..log.segment import DAMAGED_ENTRY_SIZE
from .commitlog import CommitLog
from .consumequeue import ConsumeQueue


def first_offset_past(cq: ConsumeQueue, position: int) -> int:
    """First offset whose record does not end before ``position`` (the first message of
    a batch record that ends after it)."""
    off = cq.first_offset_where(0, position)
    if off > cq.min_offset:
        pos, size, _th, _ts = cq.entry(off - 1)
        if size != DAMAGED_ENTRY_SIZE and pos + size > position:
            off = max(cq.first_offset_where(0, pos), cq.min_offset)
    return off


def read_range(log_: CommitLog, pos: int, size: int) -> bytes:
    """Log bytes [pos, pos+size), zero-filled where the log has none (never valid)."""
    try:
        data = log_.read(pos, size)
    except KeyError:  # the range reaches a lost segment: read what is there
        parts = []
        end = pos + size
        for seg in log_.segments:
            if seg.end <= pos or seg.base >= end:
                continue
            if seg.base > pos:
                parts.append(bytes(seg.base - pos))
                pos = seg.base
            n = min(end, seg.end) - pos
            parts.append(log_.read(pos, n))
            pos += n
        data = b"".join(parts)
    if len(data) < size:
        data += bytes(size - len(data))
    return data


def read_record(log_: CommitLog, topic: str, qid: int, offset: int, pos: int, size: int,
                decode: bool = False) -> bytes | RecordHead | None:
    """The record an index entry points at, or None when it is not that record."""
    try:
        raw = log_.read(pos, size)
    except KeyError:
        return None
    if not record_matches(raw, 0, size, topic.encode(), qid, offset, pos):
        return None
    if decode:
        try:
            return check_record(raw, 0, pos)
        except RecordError:
            return None
    return raw
