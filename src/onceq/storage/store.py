"""The message store: commit log + consume queues + topic configs + consumer offsets.

All methods are synchronous and run on the broker's event loop; fsync happens in the
flush service (``flush.py``) off the loop.
"""

from __future__ import annotations

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
    first_mismatch,
    tag_hash,
)
from ..log.segment import DAMAGED_ENTRY_SIZE, INDEX_ENTRY, damaged_entry
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import ConsumeQueue
from .damage import DamageRegistry
from .dedup import DedupWindow
from .dedup_journal import DedupJournal, PendingChunk
from .failures import DiskGuard, RateLimitedLog, storage_error
from .files import OS_FILES, FileOps
from .metadata import (
    RenameNotDurable,
    decode_checkpoint,
    decode_checkpoint_ends,
    encode_checkpoint,
    load_json,
    save_json,
    write_atomic,
)
from .offsets import OffsetTable
from .openfiles import OpenFiles, default_capacity, fsync_paths
from .recovery import NeedFullRebuild, Recovery, read_range, read_record

log = logging.getLogger("onceq.storage")

NAME_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
MAX_QUEUES = 1024
REPAIR_NEIGHBOURS = 16  # index entries tried on each side of a bad one to bound a repair scan
REPAIR_SCAN_BYTES = 64 * 1024 * 1024  # at most this much log is scanned to repair an entry
LOST_RUN_MAX = 100_000  # entries marked at once when their segment file is lost


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


def _damaged_run_end(cq: ConsumeQueue, offset: int) -> int:
    """The first offset after ``offset`` whose entry is not a damage marker."""
    while offset < cq.max_offset:
        raw = cq.read(offset, 1024)
        for e in INDEX_ENTRY.iter_unpack(raw):
            if e[1] != DAMAGED_ENTRY_SIZE:
                return offset
            offset += 1
    return offset


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
        self._legacy_dedup_path = os.path.join(root, "dedup-window")  # before the journal
        self.dedup_journal = DedupJournal(os.path.join(root, "dedup"), files)
        self.dedup_restored_to: int | None = None  # the journal restored the window below this
        self._queues_dir = os.path.join(root, "queues")
        files.makedirs(self._queues_dir)
        # index files and sealed commit-log segments share one bounded cache of open files
        self.open_files = OpenFiles(files, config.max_open_files or default_capacity())
        self.log = CommitLog(os.path.join(root, "commitlog"), config.segment_size, files,
                             self.open_files)
        self.topics: dict[str, TopicConfig] = {}
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self.offset_table = OffsetTable(self)
        self.dedup = DedupWindow(config.dedup_window_s, config.dedup_max_keys)
        self.recovered_records = 0
        self.damage = DamageRegistry(os.path.join(root, "damaged.json"), files)
        self._damage_dirty = False
        self._last_store_ms = 0  # store times never go backwards (search_offset bisects them)
        self.errors = RateLimitedLog(log, clock)  # one line per kind of failure per 10 s
        self.guard = DiskGuard(root, config.disk_max_used_ratio, clock, files.disk_usage,
                               on_change=self._disk_state_changed)
        # set when a failed write could not be undone (or an fsync failed): writes are
        # refused until a restart, reads go on
        self.write_failure: str | None = None

    # ================================================================ recovery
    def open(self) -> None:
        """Load topics, offsets and indexes, check the log tail, and make it durable.

        Only the log after the last checkpoint is scanned (like Kafka's recovery point):
        older records are indexed and fsynced already, trusted at start and checked on
        read, so opening takes the same time whatever the amount of data kept.
        """
        raw_topics = load_json(self._topics_path, {}, self.files)
        for name, t in raw_topics.items():
            self.topics[name] = TopicConfig(
                name, int(t["queues"]), int(t["created_position"]), int(t["created_ms"])
            )
        self.offset_table.load(load_json(self._offsets_path, None, self.files))
        self.damage.load()
        try:
            raw_checkpoint = self.files.read_file(self._checkpoint_path)
        except FileNotFoundError:
            raw_checkpoint = b""
        checkpoint = decode_checkpoint(raw_checkpoint)
        ends = decode_checkpoint_ends(raw_checkpoint) or {}
        lost_index = False
        for name, t in self.topics.items():
            for qid in range(t.queues):
                qdir = os.path.join(self._queues_dir, name, str(qid))
                try:
                    self.files.listdir(qdir)
                except FileNotFoundError:
                    # an index that vanished while the log may hold its records
                    lost_index = lost_index or checkpoint is None or (
                        t.created_position < checkpoint)
                cq = self._open_queue(name, qid)
                # fewer entries than the checkpoint saw: an index file was cut
                lost_index = lost_index or cq.lost_entries or (
                    cq.max_offset < ends.get(f"{name}/{qid}", 0))
        self._drop_unknown_queue_dirs()
        loaded_max = {key: cq.max_offset for key, cq in self.queues.items()}
        for a, b in self.log.open(empty_base=checkpoint or 0):
            self.damage.add_log(a, b)
        full = checkpoint is None or lost_index
        self._restore_dedup(None if full else checkpoint)
        if lost_index:
            log.error("store: consume-queue index files are damaged or missing; rebuilding "
                      "the indexes from the whole commit log")
            for cq in self.queues.values():
                cq.reset(0)
        try:
            self._recover(None if full else checkpoint)
        except NeedFullRebuild as exc:
            log.error("store: consume queues disagree with the commit log (%s); rebuilding "
                      "them from the whole commit log", exc)
            full = True
            self.dedup = DedupWindow(self.config.dedup_window_s, self.config.dedup_max_keys)
            for cq in self.queues.values():
                cq.reset(0)
            self._recover(None)
        if full:
            for key, cq in self.queues.items():
                if cq.max_offset == 0 and loaded_max[key] > 0:
                    cq.reset(loaded_max[key])  # no record left: never reuse its offsets
        self._move_back_topics()
        self._open_offsets()
        live = self.damaged()
        if live != self.damage.to_json() or self._damage_dirty:
            self.damage.log_ranges = live["log"]
            self.damage.queues = {(t, int(q)): r for t, qs in live["queues"].items()
                                  for q, r in qs.items()}
            try:
                self.damage.save()
                self._damage_dirty = False
            except OSError as exc:  # a full disk: kept in memory, saved with the next change
                log.error("store: cannot save the damaged ranges: %s", exc)
        # the scanned tail and the rebuilt index entries are fsynced here, before the broker
        # answers anything (a "duplicate" answer promises a durable first copy)
        try:
            self.log.sync()
        except OSError as exc:  # the recovered tail may not be durable: serve reads only
            self._fail_stop(f"fsync of the recovered commit log failed at start: {exc}")
        else:
            try:
                self.write_checkpoint()
            except OSError as exc:
                # a full disk must not keep the broker from serving reads: the previous
                # checkpoint stays valid (the next start scans a longer tail); retried later
                log.error("store: cannot write the checkpoint at start: %s", exc)

    def _move_back_topics(self) -> None:
        """Topic creation positions beyond the recovered log end are moved back to it.

        Otherwise the records the topic receives next, written from the log end, would lie
        below its creation position and be taken for an older topic's after a restart.
        """
        end = self.log.end
        moved = [t for t in self.topics.values() if t.created_position > end]
        for t in moved:
            log.error("store: topic %s was created at position %d, beyond the recovered log "
                      "end %d; moved back", t.name, t.created_position, end)
            t.created_position = end
        if moved:
            try:
                self._save_topics()
            except OSError as exc:  # moved back again at the next start
                log.error("store: cannot save the moved topics: %s", exc)

    def _open_offsets(self) -> None:
        """Replay the offset commits after the snapshot; offsets beyond a recovered queue
        end move back to it. The snapshot is written now when either changed the past."""
        table = self.offset_table
        if table.replay() | table.clamp_to_queue_ends():
            table.dirty = True
            self.save_offsets()

    def _open_queue(self, topic: str, qid: int) -> ConsumeQueue:
        cq = ConsumeQueue(os.path.join(self._queues_dir, topic, str(qid)),
                          self.config.index_entries_per_file, self.open_files)
        cq.load()
        self.queues[(topic, qid)] = cq
        return cq

    def _drop_unknown_queue_dirs(self) -> None:
        for name in self.files.listdir(self._queues_dir):
            if name not in self.topics:
                self.files.rmtree(os.path.join(self._queues_dir, name))

    def _mark_damaged(self, key: tuple[str, int], lo: int, hi: int, why: str) -> None:
        if self.damage.add_offsets(key[0], key[1], lo, hi):
            self._damage_dirty = True
        log.error("store: %s queue %d offsets %d..%d are damaged (%s); they are skipped",
                  key[0], key[1], lo, hi - 1, why)

    def _recover(self, checkpoint: int | None) -> None:
        """Index the log after ``checkpoint`` (the whole log when None); see recovery.py."""
        rec = Recovery(self.log, self.queues, self.topics, self.dedup, self.damage,
                       int(self.clock() * 1000), self._last_store_ms, self._mark_damaged)
        rec.dedup_from = self.dedup_restored_to
        rec.run(checkpoint)
        self.recovered_records = rec.records
        self._last_store_ms = rec.last_store_ms
        self._damage_dirty = self._damage_dirty or rec.damage_changed

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
            if queues == old.queues:
                return old
        self.check_writable()
        new: list[ConsumeQueue] = []
        try:
            if old is not None:
                t = TopicConfig(name, queues, old.created_position, old.created_ms)
            else:
                # the log must be durable up to created_position first: a log that ended
                # below it after a power loss would make the new topic's records look like
                # an old topic's
                self.sync_log()
                t = TopicConfig(name, queues, self.log.end, int(self.clock() * 1000))
            # index directories first: left over after a failure, the next open drops them
            for qid in range(old.queues if old else 0, queues):
                cq = ConsumeQueue(os.path.join(self._queues_dir, name, str(qid)),
                                  self.config.index_entries_per_file, self.open_files)
                new.append(cq)
                cq.load()
                cq.reset(0)
            # the table is durable before anything changes in memory
            self._write_topics({**self.topics, name: t})
        except OSError as exc:
            for cq in new:
                cq.close()
            if old is None:
                self.files.rmtree(os.path.join(self._queues_dir, name))
            else:
                for cq in new:
                    self.files.rmtree(cq.dir)
            err = storage_error(exc, f"topic {name!r} was not created")
            self.errors.error("topics", "store: cannot create topic %s: %s", name, exc)
            raise err from None
        for qid, cq in enumerate(new, start=old.queues if old else 0):
            self.queues[(name, qid)] = cq
        self.topics[name] = t
        return t

    def delete_topic(self, name: str) -> None:
        t = self.get_topic(name)
        self.check_writable(space=False)  # deleting frees space: allowed on a full disk
        table = {n: v for n, v in self.topics.items() if n != name}
        try:
            self._write_topics(table)
        except OSError as exc:
            self.errors.error("topics", "store: cannot delete topic %s: %s", name, exc)
            raise storage_error(exc, f"topic {name!r} was not deleted") from None
        del self.topics[name]
        for qid in range(t.queues):
            try:
                self.queues.pop((name, qid)).destroy()
            except OSError as exc:  # the next open drops the directory of an unknown topic
                log.warning("store: index files of deleted topic %s: %s", name, exc)
        self.files.rmtree(os.path.join(self._queues_dir, name))
        self.dedup.drop_topic(name)
        self.offset_table.drop_topic(name)

    def get_topic(self, name: str) -> TopicConfig:
        t = self.topics.get(name)
        if t is None:
            check_name("topic", name)
            raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, f"topic {name!r} does not exist")
        return t

    def _save_topics(self) -> None:
        save_json(self._topics_path, {n: t.to_json() for n, t in self.topics.items()},
                  self.files)

    def _write_topics(self, table: dict[str, TopicConfig]) -> None:
        """Make ``table`` the durable topics table, or raise with the old one in place.

        When the rename went through but its directory fsync failed, the new table is
        visible on disk while memory keeps the old one: the old table is written back, and
        when even that fails the store stops writing (a restart reads whichever is there).
        """
        try:
            save_json(self._topics_path, {n: t.to_json() for n, t in table.items()},
                      self.files)
        except RenameNotDurable as exc:
            try:
                self._save_topics()
            except OSError as again:
                self._fail_stop(f"the topics table cannot be restored: {again}")
            raise exc from None

    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            t = self.get_topic(topic)
            raise OnceqError(
                ErrorCode.INVALID_QUEUE,
                f"queue {queue_id!r} out of range for topic {topic!r} ({t.queues} queues)",
            )
        return cq

    # ================================================================ write failures
    def check_writable(self, space: bool = True) -> None:
        """Raise unless writes are accepted: not stopped by a failure, and (``space``) the
        disk is used below ``disk_max_used_ratio``."""
        if self.write_failure is not None:
            raise OnceqError(ErrorCode.STORAGE_ERROR, "writes refused until the broker "
                             f"restarts: {self.write_failure}")
        if space:
            self.guard.check()

    def write_state(self) -> dict:
        """Whether writes are accepted, why not, and the disk usage (for the status)."""
        guard = self.guard
        guard.refresh()
        reason = None
        if self.write_failure is not None:
            reason = f"stopped until a restart: {self.write_failure}"
        elif guard.refusing:
            reason = (f"DISK_FULL: disk {guard.used_ratio:.0%} used, above the limit of "
                      f"{guard.max_ratio:.0%}")
        return {"accepted": reason is None, "reason": reason,
                "disk_used": round(guard.used_ratio, 4), "disk_max_used": guard.max_ratio}

    def _disk_state_changed(self, refusing: bool, ratio: float) -> None:
        if refusing:
            log.error("store: disk %.1f%% used, above disk_max_used_ratio %.0f%%: writes "
                      "refused with DISK_FULL until space is freed", ratio * 100,
                      self.guard.max_ratio * 100)
        else:
            log.warning("store: disk %.1f%% used: writes accepted again", ratio * 100)

    def _fail_stop(self, reason: str) -> None:
        """Refuse every later write (reads go on): logged once."""
        if self.write_failure is None:
            self.write_failure = reason
            log.error("store: %s; writes are refused until the broker restarts (reads go "
                      "on)", reason)

    def fail_stop(self, reason: str, rollback_to: int | None = None) -> None:
        """Stop writing after a failed fsync (whose pages' state is unknown).

        ``rollback_to``: a commit-log position up to which everything is known durable;
        every record after it (never acknowledged: sync flush) is removed from the log and
        the indexes, so that it can never be read, nor come back after a restart.
        """
        self._fail_stop(reason)
        if rollback_to is None or rollback_to >= self.log.end:
            return
        try:
            for cq in self.queues.values():
                if cq.max_offset > cq.min_offset:
                    cq.rollback(cq.first_offset_where(0, rollback_to))
            self.log.truncate_to(rollback_to)
        except OSError as exc:
            log.error("store: cannot remove the records after position %d: %s", rollback_to,
                      exc)

    def sync_log(self) -> None:
        """Fsync the commit log; a failure stops writes (see ``fail_stop``)."""
        try:
            self.log.sync()
        except OSError as exc:
            self._fail_stop(f"fsync of the commit log failed: {exc}")
            raise

    def _undo_put(self, cq: ConsumeQueue, topic: str, position: int, offset: int,
                  exc: OSError) -> OnceqError:
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
            self._fail_stop(f"a failed write to {topic}[{cq.dir.rsplit(os.sep, 1)[-1]}] "
                            f"could not be rolled back ({exc}; then {failed})")
            return OnceqError(ErrorCode.STORAGE_ERROR, f"storage I/O error ({exc}): the write "
                              "could not be rolled back; writes refused until a restart")
        self.errors.error("put", "store: a write to %s failed and was rolled back: %s",
                          topic, exc)
        return storage_error(exc, "the write was rolled back")

    # ================================================================ writes
    def put(self, topic: str, queue_id: int, parts: Sequence[bytes | memoryview],
            dedup: bool = True, space: bool = True) -> PutResult:
        """Store message parts in one queue; all or nothing on validation errors.

        ``dedup``: apply the producer-retry dedup window (internal re-puts may opt out).
        ``space``: refuse the write above the disk usage limit (offset commits do not)."""
        cq = self._queue(topic, queue_id)
        self.check_writable(space)
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
        pos = start_pos = log_.end
        room = log_.room
        offset = start_offset = cq.max_offset
        pack_entry = INDEX_ENTRY.pack
        build = build_record_parts
        seen_tags: dict[bytes, int] = {}
        window = dedup.table(topic) if use_dedup else None
        if window is not None:  # every key looked up at once
            found, looked_up = window.find([m[0] for m in metas])
        batch_idx: list[int] = []  # the indexes of the keys in batch_keys
        try:  # a failed write (log, roll, index) leaves no trace: it is rolled back
            for i, part in enumerate(parts):
                key, tags = metas[i]
                if window is not None and key:
                    prev = found[i]
                    if prev is not None and self._still_stored(topic, prev[0], prev[1]):
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
                self._last_store_ms = now_ms
            if entries:
                cq.append(b"".join(entries), len(entries))
        except OSError as exc:
            raise self._undo_put(cq, topic, start_pos, start_offset, exc) from None
        if use_dedup and batch_keys:
            # only now that the records are written: a failed write must not turn the
            # producer's retry into a "duplicate" of a message that was never stored
            dedup.add_found(topic, looked_up, batch_idx, queue_id, list(batch_keys.values()),
                            now_ms)
            dedup.expire(now_ms)
        return PutResult(queue_id, offsets, dups, dup_queues, log_.end)

    # ================================================================ reads
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
        raise OnceqError(ErrorCode.STORAGE_ERROR, f"{topic} queue {queue_id} offset {offset}: "
                         "index repair did not converge")

    def _get(self, topic: str, queue_id: int, offset: int, max_msgs: int, max_bytes: int,
             tag_hashes: frozenset[int] | None) -> GetResult | None:
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
        picked: list[tuple[int, int, int]] = []  # (offset, position, size)
        total = 0
        scanned = 0
        for pos, size, th, _ts in INDEX_ENTRY.iter_unpack(raw):
            if size == DAMAGED_ENTRY_SIZE:
                if scanned:
                    break
                return GetResult(PullStatus.DAMAGED, b"", 0, _damaged_run_end(cq, offset),
                                 lo, hi)
            if pos < log_start:
                return GetResult(PullStatus.OFFSET_MOVED, b"", 0, lo, lo, hi)
            if picked and total + size > max_bytes:
                break
            scanned += 1
            if tag_hashes is not None and th not in tag_hashes:
                continue
            picked.append((offset + scanned - 1, pos, size))
            total += size
            if ranges and ranges[-1][0] + ranges[-1][1] == pos:
                ranges[-1][1] += size
            else:
                ranges.append([pos, size])
        payload = b"".join(read_range(self.log, p, s) for p, s in ranges)
        i = first_mismatch(payload, picked, topic.encode(), queue_id)
        if i >= 0:
            off = picked[i][0]
            if self._repair_entry(topic, queue_id, off):
                return None  # read again through the repaired entry
            if i == 0:
                return GetResult(PullStatus.DAMAGED, b"", 0, off + 1, lo, hi)
            good = sum(size for _o, _p, size in picked[:i])
            return GetResult(PullStatus.FOUND, payload[:good], i, off, lo, hi)
        nxt = offset + scanned
        if not picked and nxt == hi:
            return GetResult(PullStatus.NO_NEW_MESSAGE, b"", 0, hi, lo, hi)
        return GetResult(PullStatus.FOUND, payload, len(picked), nxt, lo, hi)

    def _repair_entry(self, topic: str, qid: int, offset: int) -> bool:
        """Find the record of ``offset`` near where it must be; fix its entry or mark it.

        The record lies between the ends of the nearest earlier and later entries that
        check out, so only that stretch (at most ``REPAIR_SCAN_BYTES``) is scanned.
        Returns True when the entry was repaired (or a run of entries into a lost segment
        file was marked): read again; False when the offset is now marked damaged.
        """
        cq = self.queues[(topic, qid)]
        log_ = self.log
        pos, size, _th, ts = cq.entry(offset)
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
            self._mark_damaged((topic, qid), offset, last + 1, "its segment file is lost")
            self._save_damage()
            return True
        lo_pos = hi_pos = None
        ts = 0
        for k in range(offset - 1, max(cq.min_offset, offset - REPAIR_NEIGHBOURS) - 1, -1):
            pos, size, _th, ets = cq.entry(k)
            if size != DAMAGED_ENTRY_SIZE and read_record(self.log, topic, qid, k, pos, size):
                lo_pos, ts = pos + size, ets
                break
        for k in range(offset + 1, min(cq.max_offset, offset + REPAIR_NEIGHBOURS + 1)):
            pos, size, _th, _ets = cq.entry(k)
            if size != DAMAGED_ENTRY_SIZE and read_record(self.log, topic, qid, k, pos, size):
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
                        and ev.queue_offset == offset and ev.position >= t.created_position):
                    cq.write_entry(offset, INDEX_ENTRY.pack(ev.position, ev.size,
                                                            ev.tags_hash, ev.store_ts_ms))
                    log.error("store: index entry of %s queue %d offset %d pointed at the "
                              "wrong bytes; repaired from the log", topic, qid, offset)
                    return True
        cq.write_entry(offset, damaged_entry(lo_pos, ts))
        self._mark_damaged((topic, qid), offset, offset + 1, "record unreadable")
        if self._damage_dirty:
            self._save_damage()
        return False

    def _save_damage(self) -> None:
        """Save the damage registry; on a full disk a read still succeeds (the markers are
        in the index entries, and the registry is saved again with the next change or at
        the next start)."""
        try:
            self.damage.save()
            self._damage_dirty = False
        except OSError as exc:
            self._damage_dirty = True
            self.errors.error("damage", "store: cannot save the damaged ranges: %s", exc)

    def damaged(self) -> dict:
        """The damaged ranges (commit-log positions and queue offsets) as JSON.

        Queue ranges are the offsets the queue still holds whose index entry is a damage
        marker (a topic deleted and created again starts clean)."""
        live = DamageRegistry(self.damage.path, self.files)
        live.log_ranges = [[max(a, self.log.start), b] for a, b in self.damage.log_ranges
                           if b > self.log.start]
        for (topic, qid), ranges in self.damage.queues.items():
            cq = self.queues.get((topic, qid))
            if cq is None:
                continue
            for a, b in ranges:
                a, b = max(a, cq.min_offset), min(b, cq.max_offset)
                for i, e in enumerate(INDEX_ENTRY.iter_unpack(cq.read(a, b - a) if b > a
                                                              else b"")):
                    if e[1] == DAMAGED_ENTRY_SIZE:
                        live.add_offsets(topic, qid, a + i, a + i + 1)
        return live.to_json()

    def min_max(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self._queue(topic, queue_id)
        return cq.min_offset, cq.max_offset

    def search_offset(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """First offset whose store time is >= ts_ms (max offset when none)."""
        return self._queue(topic, queue_id).first_offset_where(3, ts_ms)

    # ================================================================ consumer offsets
    @property
    def offsets(self) -> dict[str, dict[str, dict[str, int]]]:
        """group -> topic -> "queue" -> committed offset (see ``offsets.py``)."""
        return self.offset_table.groups

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> int:
        """Commit a group's offset; it is journaled in the commit log when it changed.

        Returns the commit-log position the commit is durable at once the log is fsynced
        up to it (a sync-flush broker answers after that)."""
        self._queue(topic, queue_id)
        check_name("group", group)
        return self.offset_table.commit(group, topic, queue_id, int(offset))

    def commit_offset_later(self, group: str, topic: str, queue_id: int, offset: int
                            ) -> None:
        """Commit a group's offset now and journal it with the next batch of such commits
        (``offset_table.flush_pending``): for commits nobody waits for."""
        self._queue(topic, queue_id)
        check_name("group", group)
        self.offset_table.commit_later(group, topic, queue_id, int(offset))

    def get_offset(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group has none for this queue."""
        self._queue(topic, queue_id)
        return self.offset_table.get(group, topic, queue_id)

    def offsets_snapshot(self) -> tuple[bytes, int] | None:
        """(``offsets.json`` content, journal records it covers) if the offsets changed
        since the last snapshot, else None. Pass both to ``write_offsets_file``.

        A caller whose write of the snapshot fails calls ``offsets_changed`` to retry later.
        """
        return self.offset_table.snapshot()

    def offsets_changed(self) -> None:
        self.offset_table.dirty = True

    def save_offsets(self) -> None:
        snap = self.offsets_snapshot()
        if snap is not None:
            self.write_offsets_file(*snap)

    # ================================================================ durability
    def write_checkpoint(self) -> None:
        """Fsync log and indexes, then record that everything before the log end is indexed."""
        end = self.log.end
        chunk = self.dedup_chunk(end)
        self.log.sync()
        self.checkpoint_at(end, self.dirty_index_files(), chunk)

    def dirty_index_files(self) -> list[str]:
        """The index files written since the last call (to fsync before a checkpoint)."""
        return [p for cq in self.queues.values() for p in cq.dirty_paths()]

    def checkpoint_at(self, end: int, index_files: list[str],
                      dedup_chunk: PendingChunk | None = None) -> None:
        """Fsync ``index_files`` and record ``end`` as indexed, then append ``dedup_chunk``
        to the dedup window's journal (safe to run off the loop)."""
        fsync_paths(self.files, index_files)
        # every entry counted here was written before: after a crash the index holds at
        # least as many (a power cut losing unsynced entries costs a full rebuild)
        ends = {f"{t}/{q}": cq.max_offset for (t, q), cq in list(self.queues.items())}
        write_atomic(self._checkpoint_path, encode_checkpoint(end, ends), self.files)
        if dedup_chunk is not None:
            d = self.dedup
            self.dedup_journal.append(dedup_chunk, d.window_ms, d.max_keys,
                                      int(self.clock() * 1000))

    def write_offsets_file(self, data: bytes, covered: int) -> None:
        """Write an offsets snapshot (safe to run off the loop)."""
        write_atomic(self._offsets_path, data, self.files)
        self.offset_table.written(covered)

    def run_retention(self) -> int:
        """Delete whole segments past the age or size limit; return segments deleted."""
        cfg = self.config
        now = self.clock()
        max_age = cfg.retention_hours * 3600

        # offset commits that no written snapshot holds yet are kept with their segments
        floor = self.offset_table.retention_floor()

        def keep(seg, total: int) -> bool:
            if floor is not None and seg.end > floor:
                return True
            if cfg.retention_bytes and total > cfg.retention_bytes:
                return False
            return not (max_age and now - self.log.mtime(seg) > max_age)

        before = len(self.log.segments)
        start = self.log.delete_segments(keep)
        if len(self.log.segments) != before:
            for cq in self.queues.values():
                cq.drop_below_position(start)
        return before - len(self.log.segments)

    def _still_stored(self, topic: str, queue_id: int, offset: int) -> bool:
        """Whether the record a "duplicate" answer would point at is intact in the log: a
        retry must be stored again rather than stand for a copy lost to disk damage."""
        cq = self.queues.get((topic, queue_id))
        if cq is None or not cq.min_offset <= offset < cq.max_offset:
            return False
        try:
            pos, size, _th, _ts = cq.entry(offset)
            return size != DAMAGED_ENTRY_SIZE and read_record(
                self.log, topic, queue_id, offset, pos, size) is not None
        except OSError:
            return False

    def _restore_dedup(self, checkpoint: int | None) -> None:
        """Fill the dedup window from its journal, when no damage is known (the log after
        the journal's end is read by the recovery)."""
        try:
            self.files.unlink(self._legacy_dedup_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("store: cannot remove %s: %s", self._legacy_dedup_path, exc)
        self.dedup_restored_to = None
        if (checkpoint is None or not self.dedup.enabled or self.damage.log_ranges
                or self.log.end < checkpoint):
            return
        self.dedup_restored_to = self.dedup_journal.load(self.dedup, checkpoint, self.log.end,
                                                   self._topic_positions())
        if self.dedup_restored_to is not None:
            log.info("store: dedup window of %d keys restored from its journal (log read "
                     "from position %d)", len(self.dedup), self.dedup_restored_to)

    def _topic_positions(self) -> dict[str, int]:
        return {n: t.created_position for n, t in self.topics.items()}

    def dedup_chunk(self, end: int) -> PendingChunk | None:
        """The dedup window's entries for its journal, up to log position ``end`` (take it
        on the loop with ``end``; ``checkpoint_at`` writes it)."""
        return self.dedup_journal.take(self.dedup, end, self._topic_positions())

    def close(self) -> None:
        # on a full or failing disk each step may fail: the files written atomically keep
        # their previous (consistent) content, and the next start recovers from it
        try:
            if self.write_failure is None:
                self.write_checkpoint()
        except OSError as exc:
            log.error("store: cannot write the checkpoint at close: %s", exc)
        try:
            self.save_offsets()
        except OSError as exc:
            log.error("store: cannot save the consumer offsets at close: %s", exc)
        self.log.close()
        for cq in self.queues.values():
            cq.close()
        self.open_files.close_all()
