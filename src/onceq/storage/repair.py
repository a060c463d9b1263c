"""Index repair and the damaged ranges: what a read does with a record that is not the one
its index entry promises.

The record is looked for near where it must be (between the nearest earlier and later
entries that check out, at most ``REPAIR_SCAN_BYTES`` of log) and its entry rewritten;
when it is not found, or its segment file is lost, the entry becomes a damage marker and
the offsets go to the damage registry (``damage.py``, shown by the broker status).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..log.record import RecordHead
from ..log.segment import DAMAGED_ENTRY_SIZE, INDEX_ENTRY, damaged_entry
from .damage import DamageRegistry
from .records import read_record

if TYPE_CHECKING:
    from .commitlog import CommitLog
    from .consumequeue import ConsumeQueue
    from .failures import RateLimitedLog
    from .topics import Topics

log = logging.getLogger("onceq.storage")

REPAIR_NEIGHBOURS = 16  # index entries tried on each side of a bad one to bound a repair scan
REPAIR_SCAN_BYTES = 64 * 1024 * 1024  # at most this much log is scanned to repair an entry
LOST_RUN_MAX = 100_000  # entries marked at once when their segment file is lost


class IndexRepair:
    """Index repair on read, and the damaged ranges of the log and the queues
    (``damage``, saved to its file when ``dirty``)."""

    def __init__(self, log_: CommitLog, topics: Topics, damage: DamageRegistry,
                 errors: RateLimitedLog) -> None:
        self.log = log_
        self.topics = topics
        self.damage = damage
        self.errors = errors
        self.dirty = False  # the registry changed since it was last saved

    def repair_entry(self, topic: str, qid: int, offset: int) -> bool:
        """Find the record of ``offset`` near where it must be; fix its entry or mark it.

        The record lies between the ends of the nearest earlier and later entries that
        check out, so only that stretch (at most ``REPAIR_SCAN_BYTES``) is scanned.
        Returns True when the entry was repaired (or a run of entries into a lost segment
        file was marked): read again; False when the offset is now marked damaged, with
        every entry next to it that points at the same bytes (the messages of one batch
        record).
        """
        cq = self.topics.queues[(topic, qid)]
        log_ = self.log
        pos, size, _th, _ts = cq.entry(offset)
        if size > DAMAGED_ENTRY_SIZE and log_.lost(pos):
            # its bytes went with a lost segment file: no scan can find them. Mark the
            # run of entries that point there at once, and read again.
            last = offset
            for k in range(offset + 1, min(cq.max_offset, offset + LOST_RUN_MAX)):
                p, sz, _th, _ts = cq.entry(k)
                if sz <= DAMAGED_ENTRY_SIZE or not log_.lost(p):
                    break
                last = k
            for k in range(offset, last + 1):
                p, _sz, _th, ets = cq.entry(k)
                cq.write_entry(k, damaged_entry(p, ets))
            self.mark_damaged((topic, qid), offset, last + 1, "its segment file is lost")
            self.save()
            return True
        # the entries that point where this one does (a batch record's messages) are
        # repaired or marked together; the neighbours are looked for around them
        run_lo, run_hi = _same_entry_run(cq, offset, pos, size)
        lo_pos = hi_pos = None
        ts = 0
        for k in range(run_lo - 1, max(cq.min_offset, run_lo - REPAIR_NEIGHBOURS) - 1, -1):
            pos, size, _th, ets = cq.entry(k)
            h = self._neighbour(topic, qid, k, pos, size)
            if h is not None:
                if self._same_batch(cq, h, topic, qid, offset):
                    return True
                lo_pos, ts = pos + size, ets
                break
        for k in range(run_hi, min(cq.max_offset, run_hi + REPAIR_NEIGHBOURS)):
            pos, size, _th, _ets = cq.entry(k)
            h = self._neighbour(topic, qid, k, pos, size)
            if h is not None:
                if self._same_batch(cq, h, topic, qid, offset):
                    return True
                hi_pos = pos
                break
        if lo_pos is None:
            lo_pos = max(log_.start, (log_.end if hi_pos is None else hi_pos)
                         - REPAIR_SCAN_BYTES)
        if hi_pos is None or hi_pos - lo_pos > REPAIR_SCAN_BYTES:
            hi_pos = min(log_.end, lo_pos + REPAIR_SCAN_BYTES)
        t = self.topics[topic]
        for seg in log_.segments:
            if seg.end <= lo_pos or seg.base >= hi_pos:
                continue
            for ev in log_.scan_segment(seg, max(0, lo_pos - seg.base), hi_pos - seg.base):
                if (isinstance(ev, RecordHead) and ev.topic == topic and ev.queue_id == qid
                        and ev.holds(offset) and ev.position >= t.created_position):
                    _write_entries(cq, ev)
                    log.error("store: index entry of %s queue %d offset %d pointed at the "
                              "wrong bytes; repaired from the log", topic, qid, offset)
                    return True
        for k in range(run_lo, run_hi):
            cq.write_entry(k, damaged_entry(lo_pos, ts))
        self.mark_damaged((topic, qid), run_lo, run_hi, "record unreadable")
        if self.dirty:
            self.save()
        return False

    def _neighbour(self, topic: str, qid: int, offset: int, pos: int, size: int
                   ) -> RecordHead | None:
        """The intact record the entry of ``offset`` points at, if any."""
        if size == DAMAGED_ENTRY_SIZE:
            return None
        h = read_record(self.log, topic, qid, offset, pos, size, decode=True)
        return h if isinstance(h, RecordHead) else None

    def _same_batch(self, cq: ConsumeQueue, h: RecordHead, topic: str, qid: int,
                    offset: int) -> bool:
        """A neighbour's batch record holds ``offset`` too: its entry is written from it."""
        if not h.holds(offset) or h.tag_hashes is None:
            return False
        _write_entries(cq, h)
        log.error("store: index entry of %s queue %d offset %d pointed at the wrong bytes; "
                  "repaired from its batch record", topic, qid, offset)
        return True

    def save(self) -> None:
        """Save the damage registry; on a full disk a read still succeeds (the markers are
        in the index entries, and the registry is saved again with the next change or at
        the next start)."""
        try:
            self.damage.save()
            self.dirty = False
        except OSError as exc:
            self.dirty = True
            self.errors.error("damage", "store: cannot save the damaged ranges: %s", exc)

    def keep_live(self) -> None:
        """At open: drop from the registry the ranges no longer held (``damaged``), and
        save it when that or the recovery changed it."""
        live = self.damaged()
        if live != self.damage.to_json() or self.dirty:
            self.damage.log_ranges = live["log"]
            self.damage.queues = {(t, int(q)): r for t, qs in live["queues"].items()
                                  for q, r in qs.items()}
            try:
                self.damage.save()
                self.dirty = False
            except OSError as exc:  # a full disk: kept in memory, saved with the next change
                log.error("store: cannot save the damaged ranges: %s", exc)

    def damaged(self) -> dict:
        """The damaged ranges (commit-log positions and queue offsets) as JSON.

        Queue ranges are the offsets the queue still holds whose index entry is a damage
        marker (a topic deleted and created again starts clean)."""
        live = DamageRegistry(self.damage.path, self.damage.files)
        live.log_ranges = [[max(a, self.log.start), b] for a, b in self.damage.log_ranges
                           if b > self.log.start]
        for (topic, qid), ranges in self.damage.queues.items():
            cq = self.topics.queues.get((topic, qid))
            if cq is None:
                continue
            for a, b in ranges:
                a, b = max(a, cq.min_offset), min(b, cq.max_offset)
                for i, e in enumerate(INDEX_ENTRY.iter_unpack(cq.read(a, b - a) if b > a
                                                              else b"")):
                    if e[1] == DAMAGED_ENTRY_SIZE:
                        live.add_offsets(topic, qid, a + i, a + i + 1)
        return live.to_json()

    def mark_damaged(self, key: tuple[str, int], lo: int, hi: int, why: str) -> None:
        if self.damage.add_offsets(key[0], key[1], lo, hi):
            self.dirty = True
        log.error("store: %s queue %d offsets %d..%d are damaged (%s); they are skipped",
                  key[0], key[1], lo, hi - 1, why)


def _write_entries(cq: ConsumeQueue, h: RecordHead) -> None:
    """The index entries of every message of record ``h`` that the queue still has and
    that do not point at it (a batch record's messages are repaired together)."""
    lo, hi = max(cq.min_offset, h.queue_offset), min(cq.max_offset, h.queue_offset + h.count)
    for off, _key, th in h.messages():
        if lo <= off < hi:
            entry = INDEX_ENTRY.pack(h.position, h.size, th, h.store_ts_ms)
            if cq.read(off, 1) != entry:
                cq.write_entry(off, entry)


def _same_entry_run(cq: ConsumeQueue, offset: int, pos: int, size: int) -> tuple[int, int]:
    """[first, end) of the offsets around ``offset`` whose entries point at (``pos``,
    ``size``), as ``offset``'s does (one message, or the messages of a batch record)."""
    if size == DAMAGED_ENTRY_SIZE:
        return offset, offset + 1
    lo = offset
    while lo > cq.min_offset:
        n = min(1024, lo - cq.min_offset)
        entries = list(INDEX_ENTRY.iter_unpack(cq.read(lo - n, n)))
        k = n
        while k and entries[k - 1][0] == pos and entries[k - 1][1] == size:
            k -= 1
        lo -= n - k
        if k:
            break
    hi = offset + 1
    while hi < cq.max_offset:
        n = min(1024, cq.max_offset - hi)
        k = 0
        for p, s, _th, _ts in INDEX_ENTRY.iter_unpack(cq.read(hi, n)):
            if p != pos or s != size:
                break
            k += 1
        hi += k
        if k < n:
            break
    return lo, hi
