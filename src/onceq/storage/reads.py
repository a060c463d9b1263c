"""Reading: messages of a queue (checked against their index entries), a queue's offset
range, and the search of an offset by store time.

Every record read is checked against what its index entry promises (size, queue, offset,
position, topic, checksum) before it is returned; one that is not goes to the index repair
(``repair.py``) and is read again, or is skipped as damaged.

A read answers a ``ReadStatus`` (the same names and numbers as the pull statuses of the
protocol) with the records found. A batch record is returned as it is stored when the read
wants at least half of its messages, else as a new batch record of the messages wanted
(``slice_batch_record``); the reader of the payload keeps the messages from the read's
offset to its next offset, with the tags it asked for (``decode_records``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from itertools import compress
from operator import ne
from typing import TYPE_CHECKING

from ..log.record import (
    first_mismatch,
    record_end_offset,
    record_matches,
    slice_batch_record,
)
from ..log.segment import DAMAGED_ENTRY_SIZE, INDEX_ENTRY
from .consumequeue import ConsumeQueue
from .errors import StoreUnavailable
from .records import read_range

if TYPE_CHECKING:
    from .commitlog import CommitLog
    from .repair import IndexRepair
    from .topics import Topics


class ReadStatus(IntEnum):
    FOUND = 0
    NO_NEW_MESSAGE = 1
    OFFSET_MOVED = 2  # the offset is below the queue's first one (retention)
    OFFSET_ILLEGAL = 3  # the offset is beyond the queue's end
    DAMAGED = 5  # offsets [requested, next) were lost to disk damage: continue at next


@dataclass(slots=True)
class GetResult:
    status: ReadStatus
    payload: bytes
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


def _damaged_run_end(cq: ConsumeQueue, offset: int) -> int:
    """The first offset after ``offset`` whose entry is not a damage marker."""
    while offset < cq.max_offset:
        raw = cq.read(offset, 1024)
        for e in INDEX_ENTRY.iter_unpack(raw):
            if e[1] != DAMAGED_ENTRY_SIZE:
                return offset
            offset += 1
    return offset


def _trimmed(payload: bytes, picked: list[tuple[int, int, int]], first: int, end: int
             ) -> bytes:
    """``payload`` (the checked records of ``picked``, back to back) with its first and
    last batch records cut to the messages in [``first``, ``end``) when less than half of
    one is wanted (``slice_batch_record``): a large batch is sent about once over the
    pulls that take it in slices, not once per pull. The records between hold only
    messages of the pull."""
    if not picked:
        return payload
    head = slice_batch_record(payload, 0, first, end)
    if len(picked) == 1:
        return payload if head is None else head
    head_end, tail_at = picked[0][2], len(payload) - picked[-1][2]
    tail = slice_batch_record(payload, tail_at, first, end)
    if head is None and tail is None:
        return payload
    return b"".join((head or payload[:head_end], payload[head_end:tail_at],
                     tail or payload[tail_at:]))


_Picked = tuple[list[tuple[int, int, int]], list[int], list[int], list[list[int]], int]


def _entries_one_by_one(raw: bytes, offset: int, log_start: int, max_bytes: int,
                        tag_hashes: frozenset[int] | None) -> _Picked | ReadStatus:
    """``_entry_runs`` entry by entry, with a tag filter: DAMAGED when the first entry is
    a damage marker (a later one ends the read), OFFSET_MOVED when an entry points below
    the log's start."""
    picked: list[tuple[int, int, int]] = []
    counts: list[int] = []
    lasts: list[int] = []
    ranges: list[list[int]] = []
    total = 0
    scanned = 0
    last = -1  # position of the last picked record (a batch record: several entries)
    for pos, size, th, _ts in INDEX_ENTRY.iter_unpack(raw):
        if size == DAMAGED_ENTRY_SIZE:
            if scanned:
                break
            return ReadStatus.DAMAGED
        if pos < log_start:
            return ReadStatus.OFFSET_MOVED
        if pos != last and picked and total + size > max_bytes:
            break
        scanned += 1
        if tag_hashes is not None and th not in tag_hashes:
            continue
        if pos == last:  # another message of the batch record picked already
            counts[-1] += 1
            lasts[-1] = offset + scanned - 1
            continue
        last = pos
        picked.append((offset + scanned - 1, pos, size))
        counts.append(1)
        lasts.append(offset + scanned - 1)
        total += size
        if ranges and ranges[-1][0] + ranges[-1][1] == pos:
            ranges[-1][1] += size
        else:
            ranges.append([pos, size])
    return picked, counts, lasts, ranges, scanned


_ENTRIES: dict[int, struct.Struct] = {}  # n -> n index entries in one call


def _entry_runs(raw: bytes, offset: int, log_start: int, max_bytes: int, max_msgs: int
                ) -> _Picked | None:
    """The records picked by the index entries ``raw`` (from ``offset``, no tag filter;
    one entry more than ``max_msgs`` when the queue has it): (offset, position, size) of
    each record, how many messages of each, the last offset of each, the log ranges to
    read, and the entries scanned. Entries that point at one record (a batch record's
    messages) are found as runs in a few calls over all the entries, so a pull of a batch
    costs a call per record, not per message. A batch record that ``max_msgs`` would cut
    at the end of a read of several records is left to the next read, which then starts
    at its first message: reads of a queue written in batches fall in step with the
    batches and send each record once, whole. None when an entry is a damage marker or
    points below the log's start (``Reader._get`` takes those entry by entry)."""
    n = len(raw) // INDEX_ENTRY.size
    k = min(n, max_msgs)
    if not k:
        return None
    st = _ENTRIES.get(n)
    if st is None:
        if len(_ENTRIES) >= 64:
            _ENTRIES.clear()
        st = _ENTRIES[n] = struct.Struct("<" + INDEX_ENTRY.format.lstrip("<") * n)
    flat = st.unpack(raw)
    poss, sizes = flat[0::4], flat[1::4]
    cut = n > k and poss[k] == poss[k - 1] and sizes[k] != DAMAGED_ENTRY_SIZE
    poss, sizes = poss[:k], sizes[:k]
    if DAMAGED_ENTRY_SIZE in sizes or min(poss) < log_start:
        return None
    if poss.count(poss[0]) == k:  # one record
        bounds = [0, k]
    else:
        bounds = [0, *compress(range(1, k), map(ne, poss[1:], poss)), k]
    if cut and len(bounds) > 2:
        bounds.pop()
    picked: list[tuple[int, int, int]] = []
    counts: list[int] = []
    lasts: list[int] = []
    ranges: list[list[int]] = []
    total = 0
    for r in range(len(bounds) - 1):
        s, e = bounds[r], bounds[r + 1]
        pos, size = poss[s], sizes[s]
        if picked and total + size > max_bytes:
            return picked, counts, lasts, ranges, s
        picked.append((offset + s, pos, size))
        counts.append(e - s)
        lasts.append(offset + e - 1)
        total += size
        if ranges and ranges[-1][0] + ranges[-1][1] == pos:
            ranges[-1][1] += size
        else:
            ranges.append([pos, size])
    return picked, counts, lasts, ranges, bounds[-1]


class Reader:
    """Reads of the queues of ``topics`` from the log, checked against their index
    entries; a record that does not check goes to ``repair``."""

    def __init__(self, log_: CommitLog, topics: Topics, repair: IndexRepair) -> None:
        self.log = log_
        self.topics = topics
        self.repair = repair

    def get(
        self, topic: str, queue_id: int, offset: int, max_msgs: int, max_bytes: int,
        tag_hashes: frozenset[int] | None = None,
    ) -> GetResult:
        """Up to ``max_msgs`` records from ``offset``, each checked against its index entry.

        A record that is not the one its index entry promises (size, queue, offset,
        position, topic, checksum) is never returned: the entry is repaired from a bounded
        scan of the log around it, or the offset is marked damaged. A pull that starts at
        damaged offsets gets ``DAMAGED`` with ``next_offset`` after them.
        """
        for _ in range(3):  # a repaired entry is read again
            res = self._get(topic, queue_id, offset, max_msgs, max_bytes, tag_hashes)
            if res is not None:
                return res
        raise StoreUnavailable(f"{topic} queue {queue_id} offset {offset}: "
                               "index repair did not converge")

    def _get(self, topic: str, queue_id: int, offset: int, max_msgs: int, max_bytes: int,
             tag_hashes: frozenset[int] | None) -> GetResult | None:
        cq = self.topics.queue(topic, queue_id)
        lo, hi = cq.min_offset, cq.max_offset
        if offset < lo:
            return GetResult(ReadStatus.OFFSET_MOVED, b"", 0, lo, lo, hi)
        if offset > hi:
            return GetResult(ReadStatus.OFFSET_ILLEGAL, b"", 0, hi, lo, hi)
        if offset == hi:
            return GetResult(ReadStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        raw = cq.read(offset, max_msgs + 1)  # one more: does a batch record go on?
        log_start = self.log.start
        sel = (_entry_runs(raw, offset, log_start, max_bytes, max_msgs) if tag_hashes is None
               else None)
        if sel is None:  # a tag filter, a damage marker or a moved start
            sel = _entries_one_by_one(raw[:max_msgs * INDEX_ENTRY.size], offset, log_start,
                                      max_bytes, tag_hashes)
        if sel is ReadStatus.DAMAGED:
            return GetResult(ReadStatus.DAMAGED, b"", 0, _damaged_run_end(cq, offset), lo, hi)
        if sel is ReadStatus.OFFSET_MOVED:
            return GetResult(ReadStatus.OFFSET_MOVED, b"", 0, lo, lo, hi)
        picked, counts, lasts, ranges, scanned = sel
        payload = (read_range(self.log, *ranges[0]) if len(ranges) == 1
                   else b"".join([read_range(self.log, p, s) for p, s in ranges]))
        i = first_mismatch(payload, picked, topic.encode(), queue_id, lasts)
        if i >= 0:
            off, pos, size = picked[i]
            at = sum(s for _o, _p, s in picked[:i])
            if record_matches(payload, at, size, topic.encode(), queue_id, off, pos):
                # an intact batch record, and a later entry pointing at it that is not one
                # of its messages: that entry is repaired (or marked damaged), the record
                # is served up to it
                bad = record_end_offset(payload, at)
                if self.repair.repair_entry(topic, queue_id, bad):
                    return None
                return GetResult(ReadStatus.FOUND,
                                 _trimmed(payload[:at + size], picked[:i + 1], offset, bad),
                                 sum(counts[:i]) + min(counts[i], bad - off), bad, lo, hi)
            if self.repair.repair_entry(topic, queue_id, off):
                return None  # read again through the repaired entry
            if i == 0:  # marked damaged, with the other messages of its batch record
                return GetResult(ReadStatus.DAMAGED, b"", 0, _damaged_run_end(cq, off), lo,
                                 hi)
            good = sum(size for _o, _p, size in picked[:i])
            return GetResult(ReadStatus.FOUND, _trimmed(payload[:good], picked[:i], offset, off),
                             sum(counts[:i]), off, lo, hi)
        nxt = offset + scanned
        if not picked and nxt == hi:
            return GetResult(ReadStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        return GetResult(ReadStatus.FOUND, _trimmed(payload, picked, offset, nxt),
                         sum(counts), nxt, lo, hi)

    def min_max(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self.topics.queue(topic, queue_id)
        return cq.min_offset, cq.max_offset

    def store_times(self, topic: str, queue_id: int) -> tuple[int | None, int | None]:
        """Store times (ms) of the queue's first and last message (None when empty); the
        index entries hold them."""
        cq = self.topics.queue(topic, queue_id)
        lo, hi = cq.min_offset, cq.max_offset
        if hi <= lo:
            return None, None
        return cq.entry(lo)[3], cq.entry(hi - 1)[3]

    def search_offset(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """First offset whose store time is >= ts_ms (max offset when none)."""
        return self.topics.queue(topic, queue_id).first_offset_where(3, ts_ms)
