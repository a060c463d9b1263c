"""The message store: commit log + consume queues + topic configs + consumer offsets.

All methods are synchronous and run on the broker's event loop; fsync happens in the
flush service (``flush.py``) off the loop.

``MessageStore`` is a facade: it builds the store's parts, opens and closes them in order,
and answers the operations most callers need. Each part is an object of its own, handed
only what it works on:

* ``topics`` (``topics.py``): the topics table, read as a map, and each topic's consume
  queues;
* ``appender`` (``put.py``): the put path (checks, dedup window, commit log, indexes);
* ``reader`` (``reads.py``): messages of a queue, checked against their index entries,
  and the search by store time; ``repair`` (``repair.py``): index repair on read and the
  damaged ranges;
* ``offsets`` (``offsets.py``): consumer offsets, journaled through the appender;
* ``gate`` (``failures.py``): whether writes are accepted;
* ``checkpoints`` (``checkpoint.py``): checkpoints and the dedup window's journal;
* ``dedup`` (``dedup.py``): the producer-retry dedup window.

Errors are ``StorageError``s (``errors.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..log.offset_record import OFFSETS_TOPIC
from .checkpoint import Checkpoints
from .commitlog import CommitLog
from .config import StoreConfig
from .damage import DamageRegistry
from .dedup import DedupWindow
from .dedup_journal import DedupJournal
from .errors import InvalidArgument
from .failures import DiskGuard, RateLimitedLog, WriteGate, disk_state_changed
from .files import OS_FILES, FileOps
from .metadata import decode_checkpoint, decode_checkpoint_ends
from .offsets import ConsumerOffsets
from .openfiles import OpenFiles, default_capacity
from .put import Appender, PutResult
from .reads import GetResult, Reader, ReadStatus
from .recovery import NeedFullRebuild, Recovery
from .repair import IndexRepair
from .topics import TopicConfig, Topics, check_name

if TYPE_CHECKING:
    from ..log.batch import CheckedBatch
    from .consumequeue import ConsumeQueue

# the types of MessageStore's answers, and the name check its callers share
__all__ = ["GetResult", "MessageStore", "PutResult", "ReadStatus", "TopicConfig",
           "check_name"]

log = logging.getLogger("onceq.storage")

OFFSETS_READ_BYTES = 16 * 1024 * 1024  # at most this much journal read at once at open


class MessageStore:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time,
                 files: FileOps = OS_FILES) -> None:
        config.validate()
        self.config = config
        self.clock = clock
        self.files = files
        root = config.data_dir
        queues_dir = os.path.join(root, "queues")
        files.makedirs(queues_dir)
        # index files and sealed commit-log segments share one bounded cache of open files
        self.open_files = OpenFiles(files, config.max_open_files or default_capacity())
        self.log = CommitLog(os.path.join(root, "commitlog"), config.segment_size, files,
                             self.open_files)
        self.errors = RateLimitedLog(log, clock)  # one line per kind of failure per 10 s
        max_ratio = config.disk_max_used_ratio
        guard = DiskGuard(root, max_ratio, clock, files.disk_usage,
                          on_change=lambda refusing, ratio: disk_state_changed(
                              refusing, ratio, max_ratio))
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self.gate = WriteGate(self.log, self.queues, guard)
        self.topics = Topics(os.path.join(root, "topics.json"), queues_dir, self.queues,
                             config.index_entries_per_file, files, self.open_files, clock,
                             self.log, self.gate, self.errors)
        self.dedup = DedupWindow(config.dedup_window_s, config.dedup_max_keys)
        self.damage = DamageRegistry(os.path.join(root, "damaged.json"), files)
        self.repair = IndexRepair(self.log, self.topics, self.damage, self.errors)
        self.reader = Reader(self.log, self.topics, self.repair)
        self.appender = Appender(self.log, self.topics, self.dedup, self.gate, config.max_body,
                                 clock, self.errors)
        self.offsets = ConsumerOffsets(
            os.path.join(root, "offsets.json"), files, self.topics, self._append_offsets,
            lambda offset, n: self.reader.get(OFFSETS_TOPIC, 0, offset, n, OFFSETS_READ_BYTES),
            self.gate, clock, self.errors)
        self.checkpoints = Checkpoints(
            os.path.join(root, "checkpoint"), self.log, self.topics, self.dedup,
            DedupJournal(os.path.join(root, "dedup"), files), self.damage, files, clock,
            os.path.join(root, "dedup-window"))
        self.recovered_records = 0
        self.dedup_restored_to: int | None = None  # the journal restored the window below this

    @property
    def write_failure(self) -> str | None:
        """Why writes stopped until a restart, or None (see ``WriteGate``)."""
        return self.gate.write_failure

    # ================================================================ open
    def open(self) -> None:
        """Load topics, offsets and indexes, check the log tail, and make it durable.

        Only the log after the last checkpoint is scanned (like Kafka's recovery point):
        older records are indexed and fsynced already, trusted at start and checked on
        read, so opening takes the same time whatever the amount of data kept.
        """
        self.topics.load()
        offsets_whole = self.offsets.load()
        self.damage.load()
        try:
            raw_checkpoint = self.files.read_file(self.checkpoints.path)
        except FileNotFoundError:
            raw_checkpoint = b""
        checkpoint = decode_checkpoint(raw_checkpoint)
        lost_index = self.topics.open_queues(checkpoint, decode_checkpoint_ends(raw_checkpoint))
        loaded_max = {key: cq.max_offset for key, cq in self.queues.items()}
        for a, b in self.log.open(empty_base=checkpoint or 0, tail_from=checkpoint):
            self.damage.add_log(a, b)
        full = checkpoint is None or lost_index
        self.dedup_restored_to = self.checkpoints.restore_dedup(None if full else checkpoint)
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
            self.dedup.reset()
            for cq in self.queues.values():
                cq.reset(0)
            self._recover(None)
        if full:
            for key, cq in self.queues.items():
                if cq.max_offset == 0 and loaded_max[key] > 0:
                    cq.reset(loaded_max[key])  # no record left: never reuse its offsets
        self.topics.move_back()
        self.offsets.open(rewrite=not offsets_whole)
        self.repair.keep_live()
        # the scanned tail and the rebuilt index entries are fsynced here, before the broker
        # answers anything (a "duplicate" answer promises a durable first copy)
        try:
            self.log.sync()
        except OSError as exc:  # the recovered tail may not be durable: serve reads only
            self.gate.stop(f"fsync of the recovered commit log failed at start: {exc}")
        else:
            try:
                self.write_checkpoint()
            except OSError as exc:
                # a full disk must not keep the broker from serving reads: the previous
                # checkpoint stays valid (the next start scans a longer tail); retried later
                log.error("store: cannot write the checkpoint at start: %s", exc)

    def _recover(self, checkpoint: int | None) -> None:
        """Index the log after ``checkpoint`` (the whole log when None); see recovery.py."""
        rec = Recovery(self.log, self.queues, self.topics, self.dedup, self.damage,
                       int(self.clock() * 1000), self.appender.last_store_ms,
                       self.repair.mark_damaged)
        rec.dedup_from = self.dedup_restored_to
        rec.run(checkpoint)
        self.recovered_records = rec.records
        self.appender.last_store_ms = rec.last_store_ms
        self.repair.dirty = self.repair.dirty or rec.damage_changed

    # ================================================================ messages
    def put(self, topic: str, queue_id: int, parts: Sequence[bytes | memoryview],
            dedup: bool = True, space: bool = True, register: bool = False) -> PutResult:
        """Store message parts in one queue; all or nothing (see ``Appender.put``)."""
        return self.appender.put(topic, queue_id, parts, dedup, space, register)

    def put_batch(self, topic: str, queue_id: int, batch: bytes,
                  checked: CheckedBatch | None = None
                  ) -> PutResult:
        """Store a producer's record batch as one batch record (``Appender.put_batch``)."""
        return self.appender.put_batch(topic, queue_id, batch, checked)

    def get(self, topic: str, queue_id: int, offset: int, max_msgs: int, max_bytes: int,
            tag_hashes: frozenset[int] | None = None) -> GetResult:
        """Up to ``max_msgs`` records from ``offset`` (see ``Reader.get``)."""
        return self.reader.get(topic, queue_id, offset, max_msgs, max_bytes, tag_hashes)

    def min_max(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.reader.min_max(topic, queue_id)

    def restart_queue(self, topic: str, queue_id: int, offset: int) -> None:
        """Make an empty queue's next offset ``offset`` (a queue moved here from a group
        where retention removed its head): its next message is stored at ``offset``, and
        the offsets below it are never used (``ConsumeQueue.reset``). Followers take the
        restart from the offset of that message's record."""
        cq = self.topics.queue(topic, queue_id)
        if cq.min_offset != cq.max_offset or offset < cq.max_offset:
            raise InvalidArgument(
                f"queue {queue_id} of topic {topic!r} holds offsets {cq.min_offset}.."
                f"{cq.max_offset}: it cannot restart at {offset}")
        if offset > cq.max_offset:
            cq.reset(offset)

    def _append_offsets(self, parts: list[bytes]) -> int:
        """Append offset-commit records to the internal topic (created at the first);
        the commit-log end after them."""
        if OFFSETS_TOPIC not in self.topics:
            self.topics.create(OFFSETS_TOPIC, 1)
        return self.appender.put(OFFSETS_TOPIC, 0, parts, dedup=False,
                                 space=False).end_position

    # ================================================================ topics
    def create_topic(self, name: str, queues: int) -> TopicConfig:
        return self.topics.create(name, queues)

    def delete_topic(self, name: str, *, keep_files: bool = False) -> str | None:
        """Delete a topic, its consume queues, its dedup keys and its consumer offsets;
        with ``keep_files``, the index directory to remove is returned (``Topics.delete``)."""
        aside = self.topics.delete(name, keep_files=keep_files)
        self.dedup.drop_topic(name)
        self.offsets.drop_topic(name)
        return aside

    def get_topic(self, name: str) -> TopicConfig:
        return self.topics.lookup(name)

    # ================================================================ consumer offsets
    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> int:
        """Commit a group's offset; the commit-log position it is durable at once the log
        is fsynced up to it (see ``ConsumerOffsets.commit``)."""
        return self.offsets.commit(group, topic, queue_id, offset)

    def delete_group(self, group: str) -> tuple[int, int]:
        """Forget a consumer group's offsets: (queues forgotten, the commit-log position
        it is durable at) (see ``ConsumerOffsets.delete_group``)."""
        return self.offsets.delete_group(group)

    def get_offset(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group has none for this queue."""
        return self.offsets.get(group, topic, queue_id)

    # ================================================================ checkpoints, retention, close
    def write_checkpoint(self) -> None:
        """Fsync log and indexes, then record that everything before the log end is indexed."""
        self.checkpoints.write()

    def run_retention(self) -> int:
        """Delete whole segments past the age or size limit; return segments deleted."""
        cfg = self.config
        now = self.clock()
        max_age = cfg.retention_hours * 3600

        # offset commits that no written snapshot holds yet are kept with their segments
        floor = self.offsets.retention_floor()

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

    def close(self) -> None:
        # on a full or failing disk each step may fail: the files written atomically keep
        # their previous (consistent) content, and the next start recovers from it
        try:
            if self.gate.write_failure is None:
                self.write_checkpoint()
        except OSError as exc:
            log.error("store: cannot write the checkpoint at close: %s", exc)
        try:
            self.offsets.save()
        except OSError as exc:
            log.error("store: cannot save the consumer offsets at close: %s", exc)
        self.log.close()
        for cq in self.queues.values():
            cq.close()
        self.open_files.close_all()
