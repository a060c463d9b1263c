"""The message store: commit log + consume queues + topic configs + consumer offsets.

All methods are synchronous and run on the broker's event loop; fsync happens in the
flush service (``flush.py``) off the loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..log.record import (
    REC_HEADER_SIZE,
    RecordError,
    RecordHead,
    build_record_parts,
    check_part,
    tag_hash,
)
from ..log.segment import INDEX_ENTRY
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from .commitlog import CommitLog, first_segment_base
from .config import StoreConfig
from .consumequeue import ConsumeQueue
from .dedup import DedupWindow
from .files import OS_FILES, FileOps
from .metadata import (
    decode_checkpoint,
    encode_checkpoint,
    load_json,
    save_json,
    write_atomic,
)

log = logging.getLogger("onceq.storage")

NAME_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
MAX_QUEUES = 1024


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise OnceqError(
            ErrorCode.INVALID_NAME,
            f"invalid {kind} name {name!r}: use 1-127 of A-Z a-z 0-9 _ - . % |",
        )
    return name


@dataclass(slots=True)
class TopicConfig:
    name: str
    queues: int
    created_position: int  # records before this commit-log position belong to older topics
    created_ms: int

    def to_json(self) -> dict:
        return {"queues": self.queues, "created_position": self.created_position,
                "created_ms": self.created_ms}


@dataclass(slots=True)
class PutResult:
    queue_id: int
    offsets: list[int]  # queue offset of each message, in order
    duplicates: list[int]  # indexes of messages that were already stored (dedup window)
    duplicate_queues: list[int]  # queue id where each duplicate was first stored
    end_position: int  # commit-log end after this write (for sync flush)


@dataclass(slots=True)
class GetResult:
    status: PullStatus
    payload: bytes
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


class _NeedFullRebuild(Exception):
    pass


class MessageStore:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time,
                 files: FileOps = OS_FILES) -> None:
        config.validate()
        self.config = config
        self.clock = clock
        self.files = files
        root = config.data_dir
        self._topics_path = os.path.join(root, "topics.json")
        self._offsets_path = os.path.join(root, "offsets.json")
        self._checkpoint_path = os.path.join(root, "checkpoint")
        self._queues_dir = os.path.join(root, "queues")
        files.makedirs(self._queues_dir)
        self.log = CommitLog(os.path.join(root, "commitlog"), config.segment_size, files)
        self.topics: dict[str, TopicConfig] = {}
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self.offsets: dict[str, dict[str, dict[str, int]]] = {}
        self.dedup = DedupWindow(config.dedup_window_s, config.dedup_max_keys)
        self._offsets_dirty = False
        self.recovered_records = 0
        self._last_store_ms = 0  # store times never go backwards (search_offset bisects them)

    # ================================================================ recovery
    def open(self) -> None:
        raw_topics = load_json(self._topics_path, {}, self.files)
        for name, t in raw_topics.items():
            self.topics[name] = TopicConfig(
                name, int(t["queues"]), int(t["created_position"]), int(t["created_ms"])
            )
        self.offsets = load_json(self._offsets_path, {}, self.files)
        for name, t in self.topics.items():
            for qid in range(t.queues):
                self._open_queue(name, qid)
        self._drop_unknown_queue_dirs()
        loaded_max = {key: cq.max_offset for key, cq in self.queues.items()}
        try:
            checkpoint = decode_checkpoint(self.files.read_file(self._checkpoint_path))
        except FileNotFoundError:
            checkpoint = None
        try:
            self._recover(checkpoint if checkpoint is not None else 0)
        except _NeedFullRebuild:
            log.warning("store: consume queues disagree with the commit log; rebuilding them")
            self.log.close()
            self.log = CommitLog(self.log.dir, self.config.segment_size, self.files)
            self.dedup = DedupWindow(self.config.dedup_window_s, self.config.dedup_max_keys)
            for cq in self.queues.values():
                cq.reset(0)
            self._recover(0)
            for key, cq in self.queues.items():
                if cq.max_offset == 0 and loaded_max[key] > 0:
                    cq.reset(loaded_max[key])  # no record left: never reuse its offsets
        self.write_checkpoint()

    def _open_queue(self, topic: str, qid: int) -> ConsumeQueue:
        cq = ConsumeQueue(os.path.join(self._queues_dir, topic, str(qid)),
                          self.config.index_entries_per_file, self.files)
        cq.load()
        self.queues[(topic, qid)] = cq
        return cq

    def _drop_unknown_queue_dirs(self) -> None:
        for name in self.files.listdir(self._queues_dir):
            if name not in self.topics:
                self.files.rmtree(os.path.join(self._queues_dir, name))

    def _recover(self, checkpoint: int) -> None:
        """Scan the commit log; index every valid record that the consume queues lack.

        Index entries at or after ``checkpoint`` may not have reached the disk before a
        crash: they are dropped and rebuilt from the log. Entries before it are trusted but
        checked against the log: a queue whose index lost entries (a deleted or cut index
        file) is completed from the log, and an index that contradicts the log raises
        ``_NeedFullRebuild``.
        """
        start = first_segment_base(self.log.dir, self.files)
        for cq in self.queues.values():
            cq.drop_below_position(start)  # so that emptying a queue keeps its next offset
            cq.truncate(cq.first_offset_where(0, checkpoint))
        indexed = {key: (cq.min_offset, cq.max_offset) for key, cq in self.queues.items()}
        last_seen: dict[tuple[str, int], int] = {}  # position of the last indexed record
        pending: dict[tuple[str, int], list[bytes]] = {}
        next_off: dict[tuple[str, int], int] = {}
        window_start = int(self.clock() * 1000) - self.dedup.window_ms
        topics = self.topics
        dedup = self.dedup
        count = 0
        max_ts = self._last_store_ms

        def on_record(h: RecordHead) -> None:
            nonlocal count, max_ts
            count += 1
            t = topics.get(h.topic)
            if t is None or h.queue_id >= t.queues or h.position < t.created_position:
                return  # a deleted topic's record
            key = (h.topic, h.queue_id)
            if h.store_ts_ms > max_ts:
                max_ts = h.store_ts_ms
            if dedup.enabled and h.store_ts_ms >= window_start and h.unique_key:
                dedup.add(h.topic, h.dedup_key, h.queue_id, h.queue_offset, h.store_ts_ms)
            expect = next_off.get(key)
            if expect is None:
                lo, hi = indexed[key]
                if h.queue_offset < hi:  # already indexed
                    if h.queue_offset < lo:
                        raise _NeedFullRebuild  # the index lost its head
                    if h.queue_offset == hi - 1:
                        last_seen[key] = h.position
                    return
                if h.queue_offset > hi:
                    if lo != hi:
                        raise _NeedFullRebuild
                    # first record of an empty queue whose head was deleted by retention
                    self.queues[key].reset(h.queue_offset)
            elif h.queue_offset != expect:
                if h.queue_offset > expect:
                    raise _NeedFullRebuild
                log.warning("store: record at %d repeats offset %d of %s; skipped",
                            h.position, h.queue_offset, key)
                return
            next_off[key] = h.queue_offset + 1
            pending.setdefault(key, []).append(
                INDEX_ENTRY.pack(h.position, h.size, h.tags_hash, h.store_ts_ms)
            )

        end = self.log.recover(on_record)
        start = self.log.start
        for key, (lo, hi) in indexed.items():
            # the last trusted entry must point at the record the log holds for it
            if hi > lo:
                pos = self.queues[key].entry(hi - 1)[0]
                if start <= pos < end and last_seen.get(key) != pos:
                    raise _NeedFullRebuild
        self.recovered_records = count
        self._last_store_ms = max_ts
        for key, entries in pending.items():
            self.queues[key].append(b"".join(entries), len(entries))
        for cq in self.queues.values():
            if cq.max_offset > cq.min_offset:
                cq.truncate(cq.first_offset_where(0, end))  # entries past a truncated tail
            cq.drop_below_position(start)
        dedup.expire(int(self.clock() * 1000))
        log.info("store: recovered %d records, commit log [%d, %d)", count, start, end)

    # ================================================================ topics
    def create_topic(self, name: str, queues: int) -> TopicConfig:
        check_name("topic", name)
        if not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"queue count must be 1..{MAX_QUEUES}")
        old = self.topics.get(name)
        if old is not None:
            if queues < old.queues:
                raise OnceqError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"topic {name!r} has {old.queues} queues; the count cannot shrink",
                )
            t = TopicConfig(name, queues, old.created_position, old.created_ms)
        else:
            # the log must be durable up to created_position first: a log that ended below it
            # after a power loss would make the new topic's records look like an old topic's
            self.log.sync()
            t = TopicConfig(name, queues, self.log.end, int(self.clock() * 1000))
        for qid in range(old.queues if old else 0, queues):
            cq = self._open_queue(name, qid)
            cq.reset(0)
        self.topics[name] = t
        self._save_topics()
        return t

    def delete_topic(self, name: str) -> None:
        t = self.get_topic(name)
        del self.topics[name]
        self._save_topics()
        for qid in range(t.queues):
            self.queues.pop((name, qid)).destroy()
        self.files.rmtree(os.path.join(self._queues_dir, name))
        self.dedup.drop_topic(name)
        for group in self.offsets.values():
            group.pop(name, None)
        self._offsets_dirty = True

    def get_topic(self, name: str) -> TopicConfig:
        t = self.topics.get(name)
        if t is None:
            check_name("topic", name)
            raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, f"topic {name!r} does not exist")
        return t

    def _save_topics(self) -> None:
        save_json(self._topics_path, {n: t.to_json() for n, t in self.topics.items()},
                  self.files)

    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            t = self.get_topic(topic)
            raise OnceqError(
                ErrorCode.INVALID_QUEUE,
                f"queue {queue_id!r} out of range for topic {topic!r} ({t.queues} queues)",
            )
        return cq

    # ================================================================ writes
    def put(self, topic: str, queue_id: int, parts: Sequence[bytes | memoryview],
            dedup: bool = True) -> PutResult:
        """Store message parts in one queue; all or nothing on validation errors.

        ``dedup``: apply the producer-retry dedup window (internal re-puts may opt out)."""
        cq = self._queue(topic, queue_id)
        max_body = self.config.max_body
        max_record = self.log.segment_size
        tb = topic.encode()
        fixed = REC_HEADER_SIZE + len(tb)
        metas = []
        for part in parts:
            try:
                key, tags, body_size, _uk = check_part(part)
            except RecordError as exc:
                raise OnceqError(ErrorCode.BAD_REQUEST, f"malformed message: {exc}") from None
            if body_size > max_body:
                raise OnceqError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message body of {body_size} bytes exceeds the limit of {max_body} bytes",
                )
            if fixed + len(part) > max_record:
                raise OnceqError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message of {len(part)} bytes (body, tags, keys and properties) does "
                    f"not fit a commit-log segment of {max_record} bytes",
                )
            metas.append((key, tags))
        now_ms = max(int(self.clock() * 1000), self._last_store_ms)
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
        pos = log_.end
        room = log_.room
        offset = cq.max_offset
        pack_entry = INDEX_ENTRY.pack
        build = build_record_parts
        seen_tags: dict[bytes, int] = {}
        window = dedup.table(topic) if use_dedup else None
        for i, part in enumerate(parts):
            key, tags = metas[i]
            if window is not None and key:
                prev = window.get(key)
                if prev is not None:
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
            self._last_store_ms = now_ms
        if entries:
            cq.append(b"".join(entries), len(entries))
        if use_dedup and batch_keys:
            # only now that the records are written: a failed write must not turn the
            # producer's retry into a "duplicate" of a message that was never stored
            for uk, off in batch_keys.items():
                dedup.add(topic, uk, queue_id, off, now_ms)
            dedup.expire(now_ms)
        return PutResult(queue_id, offsets, dups, dup_queues, log_.end)

    # ================================================================ reads
    def get(
        self, topic: str, queue_id: int, offset: int, max_msgs: int, max_bytes: int,
        tag_hashes: frozenset[int] | None = None,
    ) -> GetResult:
        cq = self._queue(topic, queue_id)
        lo, hi = cq.min_offset, cq.max_offset
        if offset < lo:
            return GetResult(PullStatus.OFFSET_MOVED, b"", 0, lo, lo, hi)
        if offset > hi:
            return GetResult(PullStatus.OFFSET_ILLEGAL, b"", 0, hi, lo, hi)
        if offset == hi:
            return GetResult(PullStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        raw = cq.read(offset, max_msgs)
        log_start = self.log.start
        ranges: list[list[int]] = []
        total = 0
        scanned = 0
        count = 0
        for pos, size, th, _ts in INDEX_ENTRY.iter_unpack(raw):
            if pos < log_start:
                return GetResult(PullStatus.OFFSET_MOVED, b"", 0, lo, lo, hi)
            if count and total + size > max_bytes:
                break
            scanned += 1
            if tag_hashes is not None and th not in tag_hashes:
                continue
            count += 1
            total += size
            if ranges and ranges[-1][0] + ranges[-1][1] == pos:
                ranges[-1][1] += size
            else:
                ranges.append([pos, size])
        read = self.log.read
        payload = b"".join(read(p, s) for p, s in ranges)
        nxt = offset + scanned
        if count == 0 and nxt == hi:
            return GetResult(PullStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        return GetResult(PullStatus.FOUND, payload, count, nxt, lo, hi)

    def min_max(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self._queue(topic, queue_id)
        return cq.min_offset, cq.max_offset

    def search_offset(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """First offset whose store time is >= ts_ms (max offset when none)."""
        return self._queue(topic, queue_id).first_offset_where(3, ts_ms)

    # ================================================================ consumer offsets
    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self._queue(topic, queue_id)
        check_name("group", group)
        g = self.offsets.setdefault(group, {}).setdefault(topic, {})
        g[str(queue_id)] = int(offset)
        self._offsets_dirty = True

    def get_offset(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group has none for this queue."""
        self._queue(topic, queue_id)
        return self.offsets.get(group, {}).get(topic, {}).get(str(queue_id), -1)

    def offsets_snapshot(self) -> bytes | None:
        """The consumer offsets as JSON if they changed since the last snapshot, else None.

        A caller whose write of the snapshot fails calls ``offsets_changed`` to retry later.
        """
        if not self._offsets_dirty:
            return None
        self._offsets_dirty = False
        return json.dumps(self.offsets, indent=1, sort_keys=True).encode()

    def offsets_changed(self) -> None:
        self._offsets_dirty = True

    def save_offsets(self) -> None:
        data = self.offsets_snapshot()
        if data is not None:
            self.write_offsets_file(data)

    # ================================================================ durability
    def write_checkpoint(self) -> None:
        """Fsync log and indexes, then record that everything before the log end is indexed."""
        self.log.sync()
        self.checkpoint_at(self.log.end, [fd for cq in self.queues.values()
                                          for fd in cq.dirty_fds()])

    def checkpoint_at(self, end: int, index_fds: list[int]) -> None:
        """Fsync ``index_fds`` and record ``end`` as indexed (safe to run off the loop)."""
        for fd in index_fds:
            # an index file closed meanwhile (topic deleted) raises OSError
            with contextlib.suppress(OSError):
                self.files.fsync(fd)
        write_atomic(self._checkpoint_path, encode_checkpoint(end), self.files)

    def write_offsets_file(self, data: bytes) -> None:
        write_atomic(self._offsets_path, data, self.files)

    def run_retention(self) -> int:
        """Delete whole segments past the age or size limit; return segments deleted."""
        cfg = self.config
        now = self.clock()
        max_age = cfg.retention_hours * 3600

        def keep(seg, total: int) -> bool:
            if cfg.retention_bytes and total > cfg.retention_bytes:
                return False
            return not (max_age and now - self.files.mtime(seg.fd) > max_age)

        before = len(self.log.segments)
        start = self.log.delete_segments(keep)
        if len(self.log.segments) != before:
            for cq in self.queues.values():
                cq.drop_below_position(start)
        return before - len(self.log.segments)

    def close(self) -> None:
        self.write_checkpoint()
        self.save_offsets()
        self.log.close()
        for cq in self.queues.values():
            cq.close()

