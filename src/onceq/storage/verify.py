"""Offline check of a data directory: every record's checksum, every index entry.

``onceq broker verify`` runs this on the data directory of a stopped broker (or a copy). It
only reads: nothing is repaired or truncated (a starting broker repairs what it can and
marks the rest damaged). The commit log is read once, in order; each queue's index is read
alongside it, so memory does not grow with the data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..log.record import RecordHead
from ..log.segment import (
    DAMAGED_ENTRY_SIZE,
    FILE_HEADER_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_MAGIC,
    LOG_MAGIC,
    FileHeaderError,
    decode_file_header,
)
from .commitlog import CommitLog, Segment
from .files import OS_FILES, FileOps
from .metadata import decode_checkpoint
from .topics import load_topics_table


@dataclass(slots=True)
class LogDamage:
    start: int  # commit-log positions [start, end)
    end: int
    reason: str


@dataclass(slots=True)
class QueueDamage:
    topic: str
    queue_id: int
    first: int  # queue offsets first..last
    last: int
    reason: str


@dataclass
class VerifyReport:
    segments: int = 0
    records: int = 0
    log_bytes: int = 0
    log: list[LogDamage] = field(default_factory=list)
    queues: list[QueueDamage] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return bool(self.log or self.queues)

    def to_json(self) -> dict:
        return {
            "segments": self.segments, "records": self.records, "log_bytes": self.log_bytes,
            "damaged": self.damaged,
            "log": [{"start": d.start, "end": d.end, "reason": d.reason} for d in self.log],
            "queues": [{"topic": d.topic, "queue": d.queue_id, "first": d.first,
                        "last": d.last, "reason": d.reason} for d in self.queues],
        }


def _index_entries(qdir: str, files: FileOps) -> Iterator[tuple[int, tuple[int, int, int, int]]]:
    """(offset, entry) of a queue's index files in order; a bad file ends the index."""
    try:
        names = sorted(n for n in files.listdir(qdir) if n.isdigit() and len(n) == 20)
    except FileNotFoundError:
        return
    for name in names:
        base = int(name)
        fd = files.open(os.path.join(qdir, name), os.O_RDONLY)
        try:
            try:
                decode_file_header(files.pread(fd, FILE_HEADER_SIZE, 0), INDEX_MAGIC, base)
            except FileHeaderError:
                return
            raw = files.pread(fd, files.size(fd), FILE_HEADER_SIZE)
        finally:
            files.close(fd)
        usable = len(raw) - len(raw) % INDEX_ENTRY_SIZE
        for i, e in enumerate(INDEX_ENTRY.iter_unpack(raw[:usable])):
            yield base + i, e


class _QueueCheck:
    """Walks one queue's index alongside the log records of that queue."""

    def __init__(self, topic: str, qid: int, qdir: str, files: FileOps, log_start: int,
                 report: VerifyReport) -> None:
        self.topic, self.qid, self.report = topic, qid, report
        self.entries = _index_entries(qdir, files)
        self.log_start = log_start
        self.current: tuple[int, tuple[int, int, int, int]] | None = None
        self._started = False
        self._advance()

    def _advance(self) -> None:
        for off, e in self.entries:
            if not self._started and (e[0] < self.log_start or not (e[1] or e[0])):
                continue  # entries of retention-deleted records, zero fill of a restart
            self._started = True
            self.current = (off, e)
            return
        self.current = None

    def _bad(self, off: int, reason: str) -> None:
        qs = self.report.queues
        last = qs[-1] if qs else None
        if (last and last.topic == self.topic and last.queue_id == self.qid
                and last.reason == reason and last.last == off - 1):
            last.last = off
        else:
            qs.append(QueueDamage(self.topic, self.qid, off, off, reason))

    def record(self, h: RecordHead | None, log_end: int, checkpoint: int = 0,
               offset: int | None = None) -> None:
        """Check index entries up to the message at ``offset`` (by default the first) of
        record ``h`` (None: the end of the log).

        A record below ``checkpoint`` must have an entry; after it, entries may still be
        missing after a crash (a start indexes them)."""
        if h is not None and offset is None:
            offset = h.queue_offset
        while True:
            if self.current is None or (offset is not None and self.current[0] > offset):
                if h is not None and offset is not None and h.position < checkpoint:
                    self._bad(offset, "no index entry (rebuilt at start)")
                return
            off, (pos, size, _th, _ts) = self.current
            if h is not None and off == offset:
                if size == DAMAGED_ENTRY_SIZE:
                    self._bad(off, "marked damaged, yet its record is intact")
                elif (pos, size) != (h.position, h.size):
                    self._bad(off, "index entry points at the wrong bytes (repaired on read)")
                self._advance()
                return
            if size == DAMAGED_ENTRY_SIZE:
                self._bad(off, "marked damaged")
            elif pos < log_end:
                self._bad(off, "record missing or unreadable")
            self._advance()


def verify_store(data_dir: str, files: FileOps = OS_FILES) -> VerifyReport:
    """Read every segment and index of ``data_dir``; report what is damaged."""
    report = VerifyReport()
    # the entries a start would skip are skipped here too (a deleted topic's records)
    topics, _skipped = load_topics_table(os.path.join(data_dir, "topics.json"), files)
    log_ = CommitLog(os.path.join(data_dir, "commitlog"), 4096, files)
    for gap_start, gap_end, reason in _open_readonly(log_):
        report.log.append(LogDamage(gap_start, gap_end, reason))
    if not log_.segments:
        return report
    start, end = log_.start, log_.end
    try:
        checkpoint = decode_checkpoint(files.read_file(os.path.join(data_dir, "checkpoint")))
    except FileNotFoundError:
        checkpoint = None
    checks = {}
    for name, t in topics.items():
        for qid in range(t.queues):
            checks[(name, qid)] = _QueueCheck(
                name, qid, os.path.join(data_dir, "queues", name, str(qid)), files, start,
                report)
    try:
        for seg in log_.segments:
            report.segments += 1
            report.log_bytes += seg.size
            for ev in log_.scan_segment(seg):
                if not isinstance(ev, RecordHead):
                    report.log.append(LogDamage(ev[0], ev[1], "no valid record"))
                    continue
                report.records += 1
                t = topics.get(ev.topic)
                if t is None or ev.position < t.created_position:
                    continue  # a deleted topic's record
                check = checks.get((ev.topic, ev.queue_id))
                if check is not None:
                    for off in range(ev.queue_offset, ev.queue_offset + ev.count):
                        check.record(ev, end, checkpoint or 0, off)
        for check in checks.values():
            check.record(None, end)
    finally:
        log_.close()
    report.log.sort(key=lambda d: d.start)
    return report


def _open_readonly(log_: CommitLog) -> list[tuple[int, int, str]]:
    """Open the segments read-only; return missing or unusable ranges."""
    fs = log_.files
    out: list[tuple[int, int, str]] = []
    try:
        names = sorted(n for n in fs.listdir(log_.dir) if n.isdigit() and len(n) == 20)
    except FileNotFoundError:
        return out
    for name in names:
        base = int(name)
        fd = fs.open(os.path.join(log_.dir, name), os.O_RDONLY)
        size = max(0, fs.size(fd) - FILE_HEADER_SIZE)
        try:
            decode_file_header(fs.pread(fd, FILE_HEADER_SIZE, 0), LOG_MAGIC, base)
        except FileHeaderError as exc:
            out.append((base, base, f"segment header damaged ({exc}); records still checked"))
        if log_.segments and base > log_.segments[-1].end:
            out.append((log_.segments[-1].end, base, "segment file missing"))
        log_.segments.append(Segment(base, os.path.join(log_.dir, name), fd, size))
    return out
