"""Recovery at start: index the commit log after the checkpoint (Kafka's recovery point).

Runs once from ``MessageStore.open``, before anything is served. The log before the
checkpoint is trusted (checked on read); the tail is scanned with resync past damaged bytes.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..log.batch import BATCH_RECORD_MAGIC
from ..log.record import (
    MAX_RECORD_SIZE,
    REC_HEAD_AND_PART,
    RECORD_MAGIC,
    RecordError,
    RecordHead,
    check_record,
)
from ..log.segment import DAMAGED_ENTRY_SIZE, INDEX_ENTRY, damaged_entry
from .commitlog import READ_CHUNK, CommitLog, Segment
from .consumequeue import ConsumeQueue
from .damage import DamageRegistry
from .dedup import DedupWindow
from .records import first_offset_past, read_range, read_record

if TYPE_CHECKING:
    from .topics import TopicConfig

log = logging.getLogger("onceq.storage")


# what the window needs of a record's two fixed headers (REC_HEAD_AND_PART): total size,
# crc, magic, queue, offset, position, store time, topic length, reconsume count, key length
_WINDOW_FIELDS = struct.Struct("<IIBxHqqqB10xHB12x")
assert _WINDOW_FIELDS.size == REC_HEAD_AND_PART.size


class NeedFullRebuild(Exception):
    """The trusted index contradicts the log: rebuild every index from the whole log."""


class Recovery:
    """One recovery pass over the log; ``records`` and ``last_store_ms`` are its results."""

    def __init__(self, log_: CommitLog, queues: dict[tuple[str, int], ConsumeQueue],
                 topics: dict, dedup: DedupWindow, damage: DamageRegistry, now_ms: int,
                 last_store_ms: int,
                 mark_damaged: Callable[[tuple[str, int], int, int, str], None]) -> None:
        self.log = log_
        self.queues = queues
        self.topics = topics
        self.dedup = dedup
        self.damage = damage
        self.now_ms = now_ms
        self.mark_damaged = mark_damaged
        self.records = 0
        self.last_store_ms = last_store_ms
        self.damage_changed = False
        # the dedup window already holds the keys of the log below this (from its journal)
        self.dedup_from: int | None = None

    def run(self, checkpoint: int | None) -> None:
        """Index the log records after ``checkpoint`` (the whole log when None).

        Index entries at or after the checkpoint may not have reached the disk before a
        crash: they are dropped and rebuilt from the log. Entries before it are trusted;
        the last one of each queue is checked against the log (an index that contradicts
        the log raises ``NeedFullRebuild``). Damaged bytes in the scanned range cost only
        the records they hold: the scan resyncs at the next valid record, and the offsets
        missing between two records of a queue are marked damaged. When two records claim
        one offset the later one wins: it is the one that was acknowledged.
        """
        log_ = self.log
        start = log_.start
        scan_from = start if checkpoint is None else min(max(checkpoint, start), log_.end)
        hints: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for key, cq in self.queues.items():
            cq.drop_below_position(start)  # so that emptying a queue keeps its next offset
            cut = first_offset_past(cq, scan_from)
            if cut < cq.max_offset:  # unchecked entries: where the log held their records
                hints[key] = [(cut + i, e[0]) for i, e in enumerate(
                    INDEX_ENTRY.iter_unpack(cq.read(cut, cq.max_offset - cut)))]
            cq.truncate(cut)
        # damage already known in the scanned range: segment files found missing at open
        damage_seen = [(a, b) for a, b in self.damage.log_ranges
                       if b > scan_from and a < log_.end]
        if checkpoint is not None:
            self.check_last_entries()
        window_start = self.now_ms - self.dedup.window_ms
        if checkpoint is not None:
            # before the tail: the window is filled oldest first
            self.dedup_below(scan_from, window_start)
        base: dict[tuple[str, int], int] = {}  # first offset of each queue's pending entries
        pending: dict[tuple[str, int], list[bytes]] = {}
        topics = self.topics
        dedup = self.dedup
        queues = self.queues
        count = 0
        damaged_bytes = sum(b - a for a, b in damage_seen)
        max_ts = max([self.last_store_ms] + [
            cq.entry(cq.max_offset - 1)[3] for cq in queues.values()
            if cq.max_offset > cq.min_offset])

        use_dedup = dedup.enabled
        # the window's keys, added in batches of columns (topic, key, queue, offset, time)
        window_cols: tuple[list, list, list, list, list] = ([], [], [], [], [])
        add_t, add_k, add_q, add_o, add_ts = (c.append for c in window_cols)

        def on_damage(a: int, b: int) -> None:
            nonlocal damaged_bytes
            damaged_bytes += b - a
            damage_seen.append((a, b))
            if self.damage.add_log(a, b):
                self.damage_changed = True
            log.error("store: commit log positions [%d, %d) hold no valid record (damaged); "
                      "skipped, later records kept", a, b)

        def on_record(h: RecordHead) -> None:
            nonlocal count, max_ts
            count += 1
            t = topics.get(h.topic)
            if t is None or h.queue_id >= t.queues or h.position < t.created_position:
                return  # a deleted topic's record
            if h.store_ts_ms > max_ts:
                max_ts = h.store_ts_ms
            in_window = use_dedup and h.store_ts_ms >= window_start
            for off, dedup_key, th in h.messages():
                if in_window and dedup_key:
                    add_t(h.topic)
                    add_k(dedup_key)
                    add_q(h.queue_id)
                    add_o(off)
                    add_ts(h.store_ts_ms)
                    if len(window_cols[0]) >= 4096:
                        dedup.add_columns(*window_cols)
                        for c in window_cols:
                            c.clear()
                on_message(h, t, off, th)

        def on_message(h: RecordHead, t: TopicConfig, off: int, th: int) -> None:
            """The index entry of the message at ``off`` of record ``h``."""
            key = (h.topic, h.queue_id)
            entries = pending.get(key)
            if entries is None:
                cq = queues[key]
                entries = pending[key] = []
                base[key] = cq.max_offset
            first = base[key]
            expect = first + len(entries)
            if off < expect:
                # a repeated offset: an earlier write that failed after reaching the log
                log.warning("store: record at %d repeats offset %d of %s; the later record "
                            "replaces the earlier one", h.position, off, key)
                if off < first:  # its entry is trusted, below the checkpoint: replace it
                    cq = queues[key]
                    if off >= cq.min_offset:
                        cq.write_entry(off, INDEX_ENTRY.pack(h.position, h.size, th,
                                                             h.store_ts_ms))
                    return
                del entries[off - first:]
            elif off > expect:
                cq = queues[key]
                if not entries and cq.max_offset == cq.min_offset and checkpoint is None \
                        and (damaged_bytes == 0 or t.created_position < start):
                    # first record of a queue whose head was deleted by retention
                    cq.reset(off)
                    base[key] = off
                elif damaged_bytes:
                    self.mark_damaged(key, expect, off, "records lost in damaged log bytes")
                    entries.extend([damaged_entry(h.position, h.store_ts_ms)] * (off - expect))
                elif checkpoint is not None:
                    raise NeedFullRebuild(f"{key} index lacks offsets {expect}..{off - 1}")
                else:
                    self.mark_damaged(key, expect, off, "records missing from the log")
                    entries.extend([damaged_entry(h.position, h.store_ts_ms)] * (off - expect))
            entries.append(INDEX_ENTRY.pack(h.position, h.size, th, h.store_ts_ms))

        end = log_.scan_tail(scan_from, on_record, on_damage)
        dedup.add_columns(*window_cols)
        for key, hint in hints.items():
            # the last records of a queue lost in damaged bytes: their offsets stay taken
            cq = queues[key]
            have = base.get(key, cq.max_offset) + len(pending.get(key, ()))
            for off, pos in reversed(hint):
                if off < have:
                    break
                if any(a <= pos < b for a, b in damage_seen):
                    self.mark_damaged(key, have, off + 1, "records lost in damaged log bytes")
                    pending.setdefault(key, [])
                    base.setdefault(key, cq.max_offset)
                    pending[key].extend([damaged_entry(pos, max_ts)] * (off + 1 - have))
                    break
        self.records = count
        self.last_store_ms = max_ts
        for key, entries in pending.items():
            if entries:
                queues[key].append(b"".join(entries), len(entries))
        for cq in queues.values():
            if cq.max_offset > cq.min_offset:
                cq.truncate(first_offset_past(cq, end))  # entries past a truncated tail
            cq.drop_below_position(log_.start)
        dedup.expire(self.now_ms)
        log.info("store: recovered %d records from position %d, commit log [%d, %d)",
                 count, scan_from, log_.start, end)

    def check_last_entries(self) -> None:
        """The last trusted entry of each queue must point at its record in the log."""
        for (topic, qid), cq in self.queues.items():
            if cq.max_offset > cq.min_offset:
                off = cq.max_offset - 1
                pos, size, _th, _ts = cq.entry(off)
                if size == DAMAGED_ENTRY_SIZE or pos < self.log.start:
                    continue
                if read_record(self.log, topic, qid, off, pos, size) is not None:
                    continue
                try:  # another valid record there: a stale index (damaged bytes are
                    # left to reads, which skip them)
                    check_record(read_range(self.log, pos, size), 0, pos)
                except RecordError:
                    continue
                raise NeedFullRebuild(f"entry {off} of {topic} queue {qid}")

    def dedup_below(self, scan_from: int, window_start: int) -> None:
        """Put the records stored in the dedup window before ``scan_from`` in the window.

        The indexes (bisected on store time) give where the window starts in the log; that
        stretch is read in one pass, oldest first. At most ``dedup_max_keys`` records are
        wanted, so the cost depends on the window's traffic, not on the data kept. When the
        window was restored from its journal, only the log after ``dedup_from`` is read.
        """
        dedup = self.dedup
        if not dedup.enabled or (self.dedup_from is not None and self.dedup_from >= scan_from):
            return
        spans = [(cq, cq.max_offset) for cq in self.queues.values()
                 if cq.first_offset_where(3, window_start) < cq.max_offset]
        if not spans:
            return
        since = window_start

        def count(ts: int) -> int:
            return sum(hi - cq.first_offset_where(3, ts) for cq, hi in spans)

        if count(since) > dedup.max_keys:  # only the newest max_keys records are kept
            lo_t, hi_t = since, max(cq.entry(hi - 1)[3] for cq, hi in spans) + 1
            while lo_t < hi_t:
                mid = (lo_t + hi_t) // 2
                if count(mid) > dedup.max_keys:
                    lo_t = mid + 1
                else:
                    hi_t = mid
            since = max(lo_t - 1, since)  # one ms more: the window trims the extra keys
        firsts = [cq.first_offset_where(3, since) for cq, _hi in spans]
        starts = [cq.entry(f)[0] for (cq, hi), f in zip(spans, firsts, strict=True) if f < hi]
        if not starts:
            return
        from_pos = max(min(starts), self.log.start, self.dedup_from or 0)
        dedup.reserve(count(since))
        for seg in self.log.segments:
            if seg.end <= from_pos or seg.base >= scan_from:
                continue
            for columns in window_keys(self.log, seg, max(0, from_pos - seg.base),
                                       scan_from - seg.base, since, self.topics):
                dedup.add_columns(*columns)


def window_keys(log_: CommitLog, seg: Segment, start_off: int, stop_off: int, since: int,
                topics: dict) -> Iterator[tuple[list, list, list, list, list]]:
    """Columns (topics, dedup keys, queues, offsets, store times) of the records of ``seg``
    between data offsets ``start_off`` and ``stop_off`` stored at or after ``since`` with a
    unique key, of live topics, in log order: the dedup window's part of a trusted stretch
    of log.

    Reads only the fixed headers, the key and the topic of each record (and its checksum):
    no per-record object. At the first record that does not check, the rest of the
    segment goes through ``scan_segment``, which resyncs past damaged bytes.
    """
    unpack = _WINDOW_FIELDS.unpack_from
    crc32 = zlib.crc32
    fixed = _WINDOW_FIELDS.size
    base = seg.base
    end = min(stop_off, seg.size)
    names: dict[bytes, object] = {}  # topic name -> its TopicConfig (None: deleted)
    last_tb = b""  # the topic of the last record, and what the filter needs of it
    last_tlen = -1
    t_name, t_queues, t_created = "", 0, 0
    off = start_off
    want = READ_CHUNK
    while off < end:
        buf = log_.read_segment(seg, off, min(want, end - off))
        view = memoryview(buf)
        n = len(buf)
        p = 0
        bad = False
        columns: tuple[list, list, list, list, list] = ([], [], [], [], [])
        add_t, add_k, add_q, add_o, add_ts = (c.append for c in columns)
        lim = min(end - off, n - fixed + 1)  # a record starts before the end, headers read
        pos0 = base + off
        while p < lim:
            total, crc, magic, qid, qoff, rpos, sts, tlen, recons, ulen = unpack(buf, p)
            if magic == BATCH_RECORD_MAGIC and rpos - p == pos0 and total <= MAX_RECORD_SIZE:
                q = p + total
                if q > n:
                    break
                try:
                    h = check_record(view[:q], p, rpos)
                except RecordError:
                    bad = True
                    break
                t = topics.get(h.topic)
                if (sts >= since and t is not None and qid < t.queues
                        and rpos >= t.created_position):
                    for o, k, _th in h.messages():
                        if k:
                            add_t(t.name)
                            add_k(k)
                            add_q(qid)
                            add_o(o)
                            add_ts(sts)
                p = q
                continue
            if (magic != RECORD_MAGIC or rpos - p != pos0 or total > MAX_RECORD_SIZE
                    or total < fixed + ulen + tlen):
                bad = True
                break
            q = p + total
            if q > n:
                break
            if crc32(view[p + 8:q]) != crc:
                bad = True
                break
            if sts >= since and ulen:
                if tlen != last_tlen or not buf.startswith(last_tb, q - tlen):
                    last_tb = buf[q - tlen:q]
                    last_tlen = tlen
                    t = names.get(last_tb, False)
                    if t is False:
                        t = names[last_tb] = topics.get(last_tb.decode("ascii", "replace"))
                    t_name, t_queues, t_created = ((t.name, t.queues, t.created_position)
                                                   if t is not None else ("", 0, 0))
                if qid < t_queues and rpos >= t_created:
                    uk = buf[p + fixed:p + fixed + ulen]
                    add_t(t_name)
                    add_k(b"%s#%d" % (uk, recons) if recons else uk)
                    add_q(qid)
                    add_o(qoff)
                    add_ts(sts)
            p = q
        off += p
        yield columns
        if bad or (p == 0 and n < want and off < end):
            break  # a record that does not check, or the segment ends inside one
        want = READ_CHUNK if p else max(want * 2, total)
    if off >= end:
        return
    for h in log_.scan_segment(seg, off, stop_off):
        if (not isinstance(h, RecordHead) or h.position >= base + stop_off
                or h.store_ts_ms < since):
            continue
        t = topics.get(h.topic)
        if t is None or h.queue_id >= t.queues or h.position < t.created_position:
            continue
        msgs = [(o, k) for o, k, _th in h.messages() if k]
        yield ([h.topic] * len(msgs), [k for _o, k in msgs], [h.queue_id] * len(msgs),
               [o for o, _k in msgs], [h.store_ts_ms] * len(msgs))
