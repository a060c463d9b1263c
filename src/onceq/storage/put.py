"""The put path: check a batch of messages, dedup check, append to the commit log, and
dispatch to the consume queue.

A put is all or nothing: a malformed or oversized message refuses the whole batch before
anything is written (``check_parts``), and a failed write (log, segment roll, index) is
rolled back to where it started (``_undo``), or stops writes when even that fails. The
dedup window is asked for every key of the batch at once and learns the new keys only once
their records are written: a failed write must not turn the producer's retry into a
"duplicate" of a message that was never stored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..log.batch import CheckedBatch, batch_parts, build_batch_record_head, check_batch
from ..log.record import (
    REC_HEADER_SIZE,
    RecordError,
    build_record_parts,
    check_part,
    record_end_offset,
    record_first_offset,
    tag_hash,
)
from ..log.segment import DAMAGED_ENTRY_SIZE, INDEX_ENTRY
from .errors import MalformedMessage, MessageTooLarge, StorageError, StoreUnavailable
from .failures import storage_error
from .records import read_record

if TYPE_CHECKING:
    from collections.abc import Callable

    from .commitlog import CommitLog
    from .consumequeue import ConsumeQueue
    from .dedup import DedupWindow
    from .failures import RateLimitedLog, WriteGate
    from .topics import Topics


@dataclass(slots=True)
class PutResult:
    queue_id: int
    offsets: list[int]  # queue offset of each message, in order
    duplicates: list[int]  # indexes of messages that were already stored (dedup window)
    duplicate_queues: list[int]  # queue id where each duplicate was first stored
    end_position: int  # commit-log end after this write (for sync flush)


def check_parts(parts: Sequence[bytes | memoryview], topic_size: int, max_body: int,
                max_record: int) -> list[tuple[bytes, bytes]]:
    """(unique key, tags) of each message part, or raise for the first one that is
    malformed or too large (a record of ``topic_size`` bytes of topic name must fit a
    segment of ``max_record`` bytes)."""
    fixed = REC_HEADER_SIZE + topic_size
    metas = []
    for part in parts:
        try:
            key, tags, body_size, _uk = check_part(part)
        except RecordError as exc:
            raise MalformedMessage(f"malformed message: {exc}") from None
        if body_size > max_body:
            raise MessageTooLarge(
                f"message body of {body_size} bytes exceeds the limit of {max_body} bytes")
        if fixed + len(part) > max_record:
            raise MessageTooLarge(
                f"message of {len(part)} bytes (body, tags, keys and properties) does "
                f"not fit a commit-log segment of {max_record} bytes")
        metas.append((key, tags))
    return metas


class Appender:
    """The put path: appends checked messages to the commit log and the consume queues of
    ``topics``, asks ``dedup`` first, refuses what ``gate`` refuses; undone when its write
    fails."""

    def __init__(self, log_: CommitLog, topics: Topics, dedup: DedupWindow, gate: WriteGate,
                 max_body: int, clock: Callable[[], float], errors: RateLimitedLog) -> None:
        self.log = log_
        self.topics = topics
        self.dedup = dedup
        self.gate = gate
        self.max_body = max_body
        self.clock = clock
        self.errors = errors
        self.last_store_ms = 0  # store times never go backwards (search_offset bisects them)

    def put(self, topic: str, queue_id: int, parts: Sequence[bytes | memoryview],
            dedup: bool = True, space: bool = True, register: bool = False) -> PutResult:
        """Store message parts in one queue; all or nothing on validation errors.

        ``dedup``: apply the producer-retry dedup window (internal re-puts may opt out).
        ``space``: refuse the write above the disk usage limit (offset commits do not).
        ``register`` (without ``dedup``): store every part, and let the window know their
        unique keys (a queue's messages copied here from another broker group: a producer
        retry of one of them is then a duplicate here too, as after a restart, when the
        window is read back from the log)."""
        cq = self.topics.queue(topic, queue_id)
        self.gate.check_writable(space)
        tb = topic.encode()
        fixed = REC_HEADER_SIZE + len(tb)
        metas = check_parts(parts, len(tb), self.max_body, self.log.segment_size)
        now_ms = max(int(self.clock() * 1000), self.last_store_ms)
        use_dedup = dedup and self.dedup.enabled
        dedup = self.dedup
        if use_dedup:
            dedup.expire(now_ms)  # the window is enforced on lookup, not only after writes
        batch_keys: dict[bytes, int] = {}  # dedup key -> offset, first copy in this batch
        offsets: list[int] = []
        dups: list[int] = []
        dup_queues: list[int] = []
        entries: list[bytes] = []
        records: list[bytes | memoryview] = []
        log_ = self.log
        pos = start_pos = log_.end
        room = log_.room
        offset = start_offset = cq.max_offset
        pack_entry = INDEX_ENTRY.pack
        build = build_record_parts
        seen_tags: dict[bytes, int] = {}
        if use_dedup:  # every key looked up at once
            found, looked_up = dedup.find(topic, [m[0] for m in metas])
        batch_idx: list[int] = []  # the indexes of the keys in batch_keys
        # (queue, position, size) -> the offsets of the intact record there (None: not one)
        checked: dict[tuple[int, int, int], range | None] = {}
        try:  # a failed write (log, roll, index) leaves no trace: it is rolled back
            for i, part in enumerate(parts):
                key, tags = metas[i]
                if use_dedup and key:
                    prev = found[i]
                    if prev is not None and self._still_stored(topic, prev[0], prev[1],
                                                               checked):
                        dups.append(i)
                        dup_queues.append(prev[0])
                        offsets.append(prev[1])
                        continue
                    first = batch_keys.get(key)
                    if first is not None:
                        dups.append(i)
                        dup_queues.append(queue_id)
                        offsets.append(first)
                        continue
                    batch_keys[key] = offset
                    batch_idx.append(i)
                size = fixed + len(part)
                if size > room:  # a record never spans two segments
                    pos = log_.roll(records)
                    room = log_.room
                head, trailer = build(tb, queue_id, offset, pos, now_ms, part)
                records += (head, part, trailer)
                th = seen_tags.get(tags)
                if th is None:
                    th = seen_tags[tags] = tag_hash(tags)
                entries.append(pack_entry(pos, size, th, now_ms))
                offsets.append(offset)
                offset += 1
                pos += size
                room -= size
            if records:
                log_.write(records)
                self.last_store_ms = now_ms
            if entries:
                cq.append(b"".join(entries), len(entries))
        except OSError as exc:
            raise self._undo(cq, topic, start_pos, start_offset, exc) from None
        if use_dedup and batch_keys:
            # only now that the records are written: a failed write must not turn the
            # producer's retry into a "duplicate" of a message that was never stored
            dedup.add_found(topic, looked_up, batch_idx, queue_id, list(batch_keys.values()),
                            now_ms)
            dedup.expire(now_ms)
        elif register and not use_dedup and dedup.enabled:
            dedup.add_many((topic, key, queue_id, start_offset + i, now_ms)
                           for i, (key, _) in enumerate(metas) if key)
        return PutResult(queue_id, offsets, dups, dup_queues, log_.end)

    def put_batch(self, topic: str, queue_id: int, batch: bytes,
                  checked: CheckedBatch | None = None,
                  dedup: bool = True) -> PutResult:
        """Store a producer's record batch in one queue as one batch record: the batch is
        checked whole (``check_batch``) and appended as received, behind the broker's own
        header; message ``i`` gets offset ``base + i``.

        A batch with a message the dedup window knows, or with one unique key twice, cannot
        be stored whole (its duplicates are not stored again): its messages then take the
        single-record path of ``put``, with the same answer. So does a batch too large for
        one commit-log segment. ``checked``: what ``check_batch`` said of ``batch``, when
        the caller checked it already."""
        cq = self.topics.queue(topic, queue_id)
        self.gate.check_writable(True)
        if checked is None:
            try:
                checked = check_batch(batch)
            except RecordError as exc:
                raise MalformedMessage(f"malformed record batch: {exc}") from None
        keys, hashes, max_body, _flags = checked
        if max_body > self.max_body:
            raise MessageTooLarge(
                f"message body of {max_body} bytes exceeds the limit of {self.max_body} bytes")
        tb = topic.encode()
        size = REC_HEADER_SIZE + len(tb) + len(batch)
        use_dedup = dedup and self.dedup.enabled
        now_ms = max(int(self.clock() * 1000), self.last_store_ms)
        window = self.dedup
        if use_dedup:
            window.expire(now_ms)
            found, looked_up = window.find(topic, keys)
            wanted = [i for i, k in enumerate(keys) if k]
            if (any(f is not None for f in found) or len({keys[i] for i in wanted})
                    < len(wanted)):
                return self._put_split(topic, queue_id, batch, dedup)
        if size > self.log.segment_size:
            return self._put_split(topic, queue_id, batch, dedup)
        log_ = self.log
        start_pos = log_.end
        base = cq.max_offset
        count = len(keys)
        try:
            pos = start_pos if size <= log_.room else log_.roll([])
            head = build_batch_record_head(tb, queue_id, base, pos, now_ms, len(batch))
            log_.write([head, batch])
            self.last_store_ms = now_ms
            pack = INDEX_ENTRY.pack
            if any(hashes):
                entries = b"".join([pack(pos, size, th, now_ms) for th in hashes])
            else:
                entries = pack(pos, size, 0, now_ms) * count
            cq.append(entries, count)
        except OSError as exc:
            raise self._undo(cq, topic, start_pos, base, exc) from None
        offsets = list(range(base, base + count))
        if use_dedup and wanted:
            window.add_found(topic, looked_up, wanted, queue_id,
                             offsets if len(wanted) == count else [base + i for i in wanted],
                             now_ms)
            window.expire(now_ms)
        return PutResult(queue_id, offsets, [], [], log_.end)

    def _put_split(self, topic: str, queue_id: int, batch: bytes, dedup: bool) -> PutResult:
        return self.put(topic, queue_id, batch_parts(batch), dedup)

    def _still_stored(self, topic: str, queue_id: int, offset: int,
                      checked: dict[tuple[int, int, int], range | None]) -> bool:
        """Whether the record a "duplicate" answer would point at is intact in the log: a
        retry must be stored again rather than stand for a copy lost to disk damage.
        ``checked``: the records read so far by this put (a retried batch's duplicates all
        point at one batch record, read once)."""
        cq = self.topics.queues.get((topic, queue_id))
        if cq is None or not cq.min_offset <= offset < cq.max_offset:
            return False
        try:
            pos, size, _th, _ts = cq.entry(offset)
            if size == DAMAGED_ENTRY_SIZE:
                return False
            where = (queue_id, pos, size)
            if where not in checked:
                raw = read_record(self.log, topic, queue_id, offset, pos, size)
                checked[where] = None if raw is None else range(
                    record_first_offset(raw, 0), record_end_offset(raw, 0))
            held = checked[where]
            return held is not None and offset in held
        except OSError:
            return False

    def _undo(self, cq: ConsumeQueue, topic: str, position: int, offset: int,
              exc: OSError) -> StorageError:
        """Roll a failed put back to the log end and queue offset it started from."""
        failed: OSError | None = None
        try:
            self.log.truncate_to(position)
        except OSError as again:
            failed = again
        try:
            cq.rollback(offset)
        except OSError as again:
            failed = failed or again
            cq.max_offset = offset  # at least never read through the failed entries
        if failed is not None:
            self.gate.stop(f"a failed write to {topic}[{cq.dir.rsplit(os.sep, 1)[-1]}] "
                            f"could not be rolled back ({exc}; then {failed})")
            return StoreUnavailable(f"storage I/O error ({exc}): the write could not be "
                                    "rolled back; writes refused until a restart")
        self.errors.error("put", "store: a write to %s failed and was rolled back: %s",
                          topic, exc)
        return storage_error(exc, "the write was rolled back")
