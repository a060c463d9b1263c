"""The writers' sequence table of a store: rebuilt at open, snapshotted to a file.

Sequences live in the messages themselves (``log/sequence.py``): the last message of each
sequenced batch carries its writer, epoch and sequence. ``writers.json`` is a snapshot of
the table that records the commit-log position it covers; at open the snapshot is loaded
and the records from that position to the log end are scanned (only the headers of
records without the ``SEQUENCED`` flag are read). A snapshot that covers more than the
recovered log (a power cut lost the tail of an unsynced log) is not trusted: the table is
then rebuilt from the whole log.

The snapshot is written every ``offsets_save_s`` when the table changed, before each
retention run (a segment is deleted only once a snapshot covers it) and at close.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgpack

from ..log.batch import BATCH_RECORD_MAGIC
from ..log.record import (
    MAX_RECORD_SIZE,
    PART_FIXED_SIZE,
    REC_HEAD_AND_PART,
    REC_HEADER_SIZE,
    RECORD_MAGIC,
    RecordError,
    batch_record_frame_ok,
    decode_records,
)
from ..log.sequence import (
    SEQ_PROPERTY,
    SEQUENCED,
    SequenceError,
    SequenceTable,
    WriterKey,
    WriterState,
    encode_writers,
    parse_marker,
)
from .metadata import load_json, write_atomic

if TYPE_CHECKING:
    from .commitlog import Segment
    from .store import MessageStore

EXPIRY_EVERY_S = 60.0

log = logging.getLogger("onceq.storage")

CHUNK = 4 * 1024 * 1024
_HEAD = REC_HEADER_SIZE + PART_FIXED_SIZE
# (topic, queue, store time, position, properties) of a record with the SEQUENCED flag
Found = tuple[str, int, int, int, dict]


class SequenceStore:
    def __init__(self, store: MessageStore, idle_expiry_s: float) -> None:
        self.store = store
        self.path = os.path.join(store.config.data_dir, "writers.json")
        self.idle_ms = int(idle_expiry_s * 1000)
        self.table = SequenceTable()
        self.replayed = 0
        self._expired_at = float("-inf")  # store clock of the last expiry pass

    # ------------------------------------------------------------------ open
    def open(self) -> None:
        """Load the snapshot and apply the sequenced records after it (after store.open)."""
        store = self.store
        start = store.log.start
        try:
            raw = load_json(self.path, None, store.files)
            if raw is not None:
                table, position = SequenceTable.decode_snapshot(raw)
                if position > store.log.end:
                    log.error("writers: the snapshot covers the log up to %d, beyond its "
                              "recovered end %d; rebuilding the table from the whole log",
                              position, store.log.end)
                else:
                    self.table, start = table, max(position, start)
        except ValueError as exc:
            log.error("writers: %s; rebuilding the table from the whole log", exc)
        for t in store.topics.values():  # writers of deleted or older topics of that name
            self.table.drop_topic(t.name, t.created_position)
        known = {k[1] for k in self.table.writers}
        for name in known - set(store.topics):
            self.table.drop_topic(name)
        for topic, qid, ts, pos, props in scan_sequenced(store, start):
            t = store.topics.get(topic)
            if (t is None or pos < t.created_position or qid >= t.queues
                    or topic.startswith("%")):  # a retry's copy keeps the flag: no writer
                continue
            try:
                writer, epoch, seq = parse_marker(props.get(SEQ_PROPERTY))
            except SequenceError as exc:
                log.error("writers: record at %d: %s; skipped", pos, exc)
                continue
            self.table.record((writer, topic, qid), epoch, seq, ts, pos)
            self.replayed += 1
        self.expire()
        self.table.dirty = True
        if self.replayed or self.table.writers:
            log.info("writers: %d sequences (%d replayed from the log)", len(self.table),
                     self.replayed)

    # ------------------------------------------------------------------ upkeep
    def expire(self) -> int:
        """Forget idle writers; a pass over the whole table, so at most once a minute or a
        tenth of the expiry time, whichever is shorter (the expiry is counted in days)."""
        now = self.store.clock()
        if now - self._expired_at < min(EXPIRY_EVERY_S, self.idle_ms / 10_000):
            return 0
        self._expired_at = now
        n = self.table.expire(int(now * 1000), self.idle_ms)
        if n:
            log.info("writers: %d idle writer sequences expired", n)
        return n

    def snapshot(self) -> tuple[dict[WriterKey, WriterState], int] | None:
        """The table to write if it changed, and the log end it covers: a shallow copy
        taken on the loop (consistent with that end; entries are never changed in place),
        to be encoded and written by ``write`` off the loop."""
        if not self.table.dirty:
            return None
        self.table.dirty = False
        return dict(self.table.writers), self.store.log.end

    def write(self, snap: tuple[dict[WriterKey, WriterState], int]) -> None:
        """Encode and write a snapshot (safe to run off the loop); on failure it is taken
        again."""
        try:
            write_atomic(self.path, encode_writers(*snap), self.store.files)
        except OSError:
            self.table.dirty = True
            raise

    def save(self) -> None:
        data = self.snapshot()
        if data is not None:
            self.write(data)


def scan_sequenced(store: MessageStore, start: int) -> Iterator[Found]:
    """The records with the SEQUENCED flag from commit-log position ``start`` on."""
    for seg in list(store.log.segments):
        if seg.end > start:
            yield from _scan_segment(store, seg, max(0, start - seg.base))


def _scan_segment(store: MessageStore, seg: Segment, off: int) -> Iterator[Found]:
    unpack = REC_HEAD_AND_PART.unpack_from
    read = store.log.read_segment
    want = CHUNK
    while off < seg.size:
        size = min(want, seg.size - off)
        buf = read(seg, off, size)
        n = len(buf)
        p = 0
        while n - p >= _HEAD:
            (total, crc, magic, _r, qid, _qoff, rpos, sts, tlen,
             _born, flags, _rc, ulen, tgl, kl, pl, bl) = unpack(buf, p)
            if magic == BATCH_RECORD_MAGIC:
                if rpos != seg.base + off + p or not REC_HEADER_SIZE < total <= MAX_RECORD_SIZE:
                    yield from _resync(store, seg, off + p)  # damaged bytes: the careful way
                    return
                if p + total > n:
                    break
                if not batch_record_frame_ok(buf, p, total):
                    yield from _resync(store, seg, off + p)
                    return
                p += total  # a record batch never carries the flag (refused at its send)
                continue
            if (magic != RECORD_MAGIC or rpos != seg.base + off + p or total > MAX_RECORD_SIZE
                    or total != _HEAD + ulen + tgl + kl + pl + bl + tlen):
                yield from _resync(store, seg, off + p)  # damaged bytes: the careful way
                return
            if p + total > n:
                break
            if flags & SEQUENCED:
                view = memoryview(buf)[p:p + total]
                if zlib.crc32(view[8:]) == crc:
                    q = _HEAD + ulen + tgl + kl
                    try:
                        props = msgpack.unpackb(view[q:q + pl], raw=False) if pl else {}
                        topic = str(view[total - tlen:], "ascii")
                    except Exception:  # a part is checked when stored: not expected
                        props = None
                    if isinstance(props, dict):
                        yield topic, qid, sts, rpos, props
            p += total
        if p == 0:  # a record larger than the chunk, or bytes that end inside a header
            if n < size or want >= MAX_RECORD_SIZE:
                yield from _resync(store, seg, off)
                return
            want = MAX_RECORD_SIZE
            continue
        want = CHUNK
        off += p


def _resync(store: MessageStore, seg: Segment, off: int) -> Iterator[Found]:
    """From ``off`` through ``scan_segment``, which skips damaged bytes (rare: slow path)."""
    for ev in store.log.scan_segment(seg, off):
        if isinstance(ev, tuple):
            log.error("writers: commit-log bytes %d..%d hold no record; skipped", *ev)
            continue
        try:
            raw = store.log.read(ev.position, ev.size)
            for m in decode_records(raw):
                if m.flags & SEQUENCED:
                    yield m.topic, m.queue_id, m.store_ts_ms, m.position, m.properties
        except (OSError, RecordError) as exc:
            log.error("writers: record at %d unreadable: %s", ev.position, exc)

