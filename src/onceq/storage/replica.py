"""A broker group's log replication, on the store's side: the leader reads whole records
from a position; a follower checks them, appends them verbatim at the same positions,
indexes them and feeds its dedup window as recovery does; a returning replica cuts its
divergent tail.

Positions are the same on every replica: a record never spans two segments, and a new
segment starts where the previous one ends, so a follower rolls its segments wherever its
own segment size says and still writes each record at the position it claims.

``split_records`` is a pure function of bytes; ``ReplicaLog`` works on a ``MessageStore``.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import TYPE_CHECKING, Any

from ..log.record import MAX_RECORD_SIZE, RecordError, RecordHead, check_record
from ..log.segment import INDEX_ENTRY
from .errors import StorageError
from .records import first_offset_past
from .recovery import window_keys
from .topics import TopicConfig

if TYPE_CHECKING:
    from .store import MessageStore

log = logging.getLogger("onceq.storage")

_TOTAL = struct.Struct("<I")  # every record starts with its total size


class ReplicaDataError(StorageError):
    """Bytes from the leader that are not whole valid records at the positions they claim."""


def whole_records(buf: bytes, limit: int) -> int:
    """How many bytes of ``buf`` make whole records, at most ``limit`` of them (but at
    least the first record when it is whole, however large)."""
    p = 0
    n = len(buf)
    while n - p >= _TOTAL.size:
        total = _TOTAL.unpack_from(buf, p)[0]
        if total <= 0 or total > MAX_RECORD_SIZE or p + total > n:
            break
        if p and p + total > limit:
            break
        p += total
    return p


def split_records(buf: bytes | memoryview, position: int) -> list[RecordHead]:
    """The records of ``buf``, which starts at commit-log ``position``: each must check
    (its checksum, and the position it claims), and together they must fill ``buf``.
    Raises ``ReplicaDataError`` naming the first position that does not."""
    heads: list[RecordHead] = []
    p = 0
    n = len(buf)
    while p < n:
        try:
            h = check_record(buf, p, position + p)
        except RecordError as exc:
            raise ReplicaDataError(f"replicated bytes at position {position + p} are not a "
                                   f"valid record: {exc}") from None
        heads.append(h)
        p += h.size
    return heads


def topics_signature(table: list[list[Any]]) -> str:
    """A short digest of a topics table (as ``topics_table`` gives it): names, queue
    counts and creation positions (a follower keeps its own creation times)."""
    return hashlib.blake2b(repr([row[:3] for row in table]).encode(),
                           digest_size=8).hexdigest()


class _Plan:
    """What appending fetched records does to the indexes and the dedup window."""

    def __init__(self, last_ms: int) -> None:
        self.entries: dict[tuple[str, int], list[bytes]] = {}
        self.base: dict[tuple[str, int], int] = {}  # each queue's first offset here
        self.cols: tuple[list, list, list, list, list] = ([], [], [], [], [])
        self.last_ms = last_ms


class ReplicaLog:
    """What replication does to one store."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self._sig: tuple[int, str] | None = None  # (table identity, signature) cache

    # ---------------------------------------------------------------- the leader's side
    def read(self, position: int, max_bytes: int) -> bytes:
        """Whole records from ``position`` (a record boundary) up to ``max_bytes`` (at
        least one record when there is one)."""
        log_ = self.store.log
        end = log_.end
        if position >= end:
            return b""
        want = min(end - position, max(max_bytes, 4096))
        buf = log_.read(position, want)
        n = whole_records(buf, max_bytes)
        if n == 0 and len(buf) >= _TOTAL.size:  # a first record larger than the read
            total = _TOTAL.unpack_from(buf, 0)[0]
            if 0 < total <= min(MAX_RECORD_SIZE, end - position):
                return log_.read(position, total)
        return buf[:n]

    def topics_table(self) -> list[list[Any]]:
        """The topics as [name, queues, created position, created ms], by name."""
        return [[t.name, t.queues, t.created_position, t.created_ms]
                for t in sorted(self.store.topics.values(), key=lambda t: t.name)]

    # ---------------------------------------------------------------- the follower's side
    def sync_topics(self, table: list[list[Any]]) -> None:
        """Make the topics what the leader's table says: create the missing ones (at the
        leader's creation position), grow queue counts, delete the others."""
        store = self.store
        topics = store.topics
        wanted: dict[str, TopicConfig] = {}
        for row in table:
            t = TopicConfig.from_json(row[0], {"queues": row[1], "created_position": row[2],
                                               "created_ms": row[3]})
            wanted[t.name] = t
        for name in [n for n in topics if n not in wanted]:
            log.info("replica: topic %s is gone on the leader: deleted", name)
            store.delete_topic(name)
        for name, t in wanted.items():
            cur = topics.get(name)
            if cur is not None and cur.created_position != t.created_position:
                log.info("replica: topic %s was created again on the leader", name)
                store.delete_topic(name)
                cur = None
            if cur is None or cur.queues < t.queues:
                if cur is None:
                    topics.commit_create(name, t.queues, t.created_position)
                topics.create(name, t.queues)

    def append(self, position: int, data: bytes) -> int:
        """Append the leader's records ``data``, which start at ``position`` (this log's
        end), check each, index them and put their keys in the dedup window; the number of
        records. Nothing is written when one does not check."""
        store = self.store
        log_ = store.log
        if position != log_.end:
            raise ReplicaDataError(f"fetched bytes start at {position}, the log ends at "
                                   f"{log_.end}")
        heads = split_records(data, position)
        if not heads:
            return 0
        store.gate.check_writable(False)
        plan = self._plan(heads)  # checked before anything is written
        view = memoryview(data)
        pending: list[bytes | memoryview] = []
        room = log_.room
        for h in heads:
            if h.size > room:  # a record never spans two segments
                log_.roll(pending)  # type: ignore[arg-type]
                room = log_.room
            off = h.position - position
            pending.append(view[off:off + h.size])
            room -= h.size
        if pending:
            log_.write(pending)  # type: ignore[arg-type]
        self._apply(plan)
        return len(heads)

    def _plan(self, heads: list[RecordHead]) -> _Plan:
        """The index entries and dedup keys of ``heads``; raises when a record's offsets
        do not follow its queue's."""
        store = self.store
        topics = store.topics
        queues = store.queues
        dedup = store.dedup
        window_start = int(store.clock() * 1000) - dedup.window_ms
        plan = _Plan(store.appender.last_store_ms)
        cols = plan.cols
        for h in heads:
            t = topics.get(h.topic)
            if t is None or h.queue_id >= t.queues or h.position < t.created_position:
                continue  # a deleted topic's record
            key = (h.topic, h.queue_id)
            cq = queues[key]
            entries = plan.entries.get(key)
            if entries is None:
                entries = plan.entries[key] = []
                plan.base[key] = cq.max_offset
            plan.last_ms = max(plan.last_ms, h.store_ts_ms)
            for off, dedup_key, th in h.messages():
                expect = plan.base[key] + len(entries)
                if off != expect:
                    if off < expect or entries or cq.max_offset != cq.min_offset:
                        raise ReplicaDataError(
                            f"record at {h.position} holds offset {off} of {key}, where "
                            f"this replica expects {expect}")
                    plan.base[key] = off  # the queue's head went to retention on the leader
                entries.append(INDEX_ENTRY.pack(h.position, h.size, th, h.store_ts_ms))
                if dedup.enabled and dedup_key and h.store_ts_ms >= window_start:
                    for c, v in zip(cols, (h.topic, dedup_key, h.queue_id, off,
                                           h.store_ts_ms), strict=True):
                        c.append(v)
        return plan

    def _apply(self, plan: _Plan) -> None:
        store = self.store
        for key, entries in plan.entries.items():
            cq = store.queues[key]
            if plan.base[key] != cq.max_offset:
                cq.reset(plan.base[key])
            if entries:
                cq.append(b"".join(entries), len(entries))
        store.appender.last_store_ms = plan.last_ms
        if plan.cols[0]:
            store.dedup.add_columns(*plan.cols)

    def truncate(self, position: int) -> None:
        """Cut the log at ``position`` (a record boundary below the end): the records
        after it go from the log, the indexes and the dedup window."""
        store = self.store
        log_ = store.log
        if position >= log_.end:
            return
        log.warning("replica: cutting the commit log at %d (was %d): a tail the leader "
                    "never acknowledged", position, log_.end)
        for cq in store.queues.values():
            if cq.max_offset > cq.min_offset:
                cut = first_offset_past(cq, position)
                if cut < cq.max_offset:
                    cq.rollback(cut)
        log_.truncate_to(position)
        self._rebuild_dedup()

    def _rebuild_dedup(self) -> None:
        """The dedup window again from the log (keys of the cut records must go)."""
        store = self.store
        dedup = store.dedup
        dedup.reset()
        if not dedup.enabled:
            return
        now_ms = int(store.clock() * 1000)
        since = now_ms - dedup.window_ms
        for seg in list(store.log.segments):
            for columns in window_keys(store.log, seg, 0, seg.size, since, store.topics):
                dedup.add_columns(*columns)
        dedup.expire(now_ms)
