"""The message store: commit log + consume queues + topic configs + consumer offsets.

All methods are synchronous and run on the broker's event loop; fsync happens in the
flush service (``flush.py``) off the loop.

``MessageStore`` holds the store's state and its life (open, retention, close); its
operations are grouped by concept in the modules of its bases:

* ``topics.py``: topic names, the topics table, each topic's consume queues;
* ``put.py``: the put path (checks, dedup check, commit log, consume-queue dispatch);
* ``reads.py``: messages of a queue, a queue's offset range, search by store time;
* ``repair.py``: index repair on read, and the damaged ranges;
* ``offsets.py``: consumer offsets (``ConsumerOffsets``);
* ``failures.py``: whether writes are accepted (``WriteGate``);
* ``checkpoint.py``: checkpoints and the dedup window's journal.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from .checkpoint import Checkpoints
from .commitlog import CommitLog
from .config import StoreConfig
from .consumequeue import ConsumeQueue
from .damage import DamageRegistry
from .dedup import DedupWindow
from .dedup_journal import DedupJournal
from .failures import DiskGuard, RateLimitedLog, WriteGate
from .files import OS_FILES, FileOps
from .metadata import decode_checkpoint, decode_checkpoint_ends
from .offsets import ConsumerOffsets, OffsetTable
from .openfiles import OpenFiles, default_capacity
from .put import PutPath, PutResult
from .reads import GetResult, Reads
from .recovery import NeedFullRebuild, Recovery
from .repair import IndexRepair
from .topics import TopicConfig, Topics, check_name

# the types of MessageStore's answers, and the name check its callers share
__all__ = ["GetResult", "MessageStore", "PutResult", "TopicConfig", "check_name"]

log = logging.getLogger("onceq.storage")


class MessageStore(Topics, PutPath, Reads, IndexRepair, ConsumerOffsets, WriteGate,
                   Checkpoints):
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
        self.skipped_topics: dict[str, object] = {}  # entries of topics.json out of bounds
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

    # ================================================================ open
    def open(self) -> None:
        """Load topics, offsets and indexes, check the log tail, and make it durable.

        Only the log after the last checkpoint is scanned (like Kafka's recovery point):
        older records are indexed and fsynced already, trusted at start and checked on
        read, so opening takes the same time whatever the amount of data kept.
        """
        self._load_topics()
        offsets_whole = self._load_offsets()
        self.damage.load()
        try:
            raw_checkpoint = self.files.read_file(self._checkpoint_path)
        except FileNotFoundError:
            raw_checkpoint = b""
        checkpoint = decode_checkpoint(raw_checkpoint)
        ends = decode_checkpoint_ends(raw_checkpoint)
        lost_index = False
        for name, t in self.topics.items():
            for qid in range(t.queues):
                try:
                    self.files.listdir(self._queue_dir(name, qid))
                except FileNotFoundError:
                    # an index that vanished while the log may hold its records
                    lost_index = lost_index or checkpoint is None or (
                        t.created_position < checkpoint)
                cq = self._open_queue(name, qid)
                # entries lost before kept ones, or fewer entries than the checkpoint
                # counted: an index file was cut or lost. Entries past that count may be
                # missing after a power cut (no checkpoint fsynced them yet): the tail scan
                # rebuilds them. Without the counts, any lost last entry may have been
                # below the checkpoint.
                lost_index = lost_index or cq.lost_entries or (
                    cq.lost_tail if ends is None
                    else cq.max_offset < ends.get(f"{name}/{qid}", 0))
        self._drop_unknown_queue_dirs()
        loaded_max = {key: cq.max_offset for key, cq in self.queues.items()}
        for a, b in self.log.open(empty_base=checkpoint or 0, tail_from=checkpoint):
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
        self._open_offsets(rewrite=not offsets_whole)
        self._keep_live_damage()
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

    def _recover(self, checkpoint: int | None) -> None:
        """Index the log after ``checkpoint`` (the whole log when None); see recovery.py."""
        rec = Recovery(self.log, self.queues, self.topics, self.dedup, self.damage,
                       int(self.clock() * 1000), self._last_store_ms, self._mark_damaged)
        rec.dedup_from = self.dedup_restored_to
        rec.run(checkpoint)
        self.recovered_records = rec.records
        self._last_store_ms = rec.last_store_ms
        self._damage_dirty = self._damage_dirty or rec.damage_changed

    # ================================================================ retention and close
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
