"""The commit log: append-only segment files named by their base position.

Positions are global byte positions across segments (segment base + offset in the segment's
data area). A segment holds at most ``segment_size`` data bytes; a record never spans two
segments. Writes go through ``pwrite`` into the page cache; ``sync()`` fsyncs the
segments touched since the last sync. Reads use ``pread``. File calls go through ``FileOps``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..log.record import (
    RECORD_MAGIC,
    RecordError,
    RecordHead,
    TruncatedRecord,
    check_record,
)
from ..log.segment import (
    FILE_HEADER_SIZE,
    LOG_MAGIC,
    FileHeaderError,
    decode_file_header,
    encode_file_header,
    file_name,
)
from .files import OS_FILES, FileOps

log = logging.getLogger("onceq.storage")

READ_CHUNK = 8 * 1024 * 1024
_MAGIC = bytes([RECORD_MAGIC])


@dataclass(slots=True)
class Segment:
    base: int
    path: str
    fd: int
    size: int  # data bytes (excluding the file header)
    mtime: float = 0.0

    @property
    def end(self) -> int:
        return self.base + self.size


class CommitLog:
    def __init__(self, directory: str, segment_size: int, files: FileOps = OS_FILES) -> None:
        if segment_size < 4096:
            raise ValueError("segment size must be at least 4096 bytes")
        self.dir = directory
        self.files = files
        self.segment_size = segment_size
        self.segments: list[Segment] = []
        self._dirty: set[int] = set()  # fds written since the last sync
        files.makedirs(directory)

    # ---------------------------------------------------------------- recovery
    def open(self, empty_base: int = 0) -> list[tuple[int, int]]:
        """Open every segment without reading its records; return the missing ranges.

        Older segments are trusted at start (their records are checked on read and by
        ``onceq broker verify``), so opening costs the same whatever the data size. A
        damaged file header is rewritten from the file name (records carry their own
        position and checksum). A segment missing between two others leaves a gap of
        positions, returned as ``(start, end)`` ranges; later segments are kept.
        """
        fs = self.files
        gaps: list[tuple[int, int]] = []
        for name in _segment_names(self.dir, fs):
            path = os.path.join(self.dir, name)
            base = int(name)
            fd = fs.open(path, os.O_RDWR)
            try:
                decode_file_header(fs.pread(fd, FILE_HEADER_SIZE, 0), LOG_MAGIC, base)
            except FileHeaderError as exc:
                size = fs.size(fd)
                (log.error if size > FILE_HEADER_SIZE else log.warning)(
                    "commit log: segment %s header damaged (%s); rewritten", name, exc)
                fs.write_all(fd, encode_file_header(LOG_MAGIC, base), 0)
                fs.fsync(fd)
            if self.segments and base < self.segments[-1].end:
                # overlapping segments cannot come from onceq: keep the older bytes
                log.error("commit log: segment %s overlaps the previous one; ignored", name)
                fs.close(fd)
                continue
            if self.segments and base > self.segments[-1].end:
                gaps.append((self.segments[-1].end, base))
                log.error("commit log: positions [%d, %d) are missing (a segment file was "
                          "lost); later segments are kept", self.segments[-1].end, base)
            size = max(0, fs.size(fd) - FILE_HEADER_SIZE)
            self.segments.append(Segment(base, path, fd, size, fs.mtime(fd)))
        if not self.segments:
            self._new_segment(empty_base)
        return gaps

    def scan_tail(self, start: int, on_record: Callable[[RecordHead], None],
                  on_damage: Callable[[int, int], None]) -> int:
        """Check every record from ``start`` to the end of the log; return the end.

        ``on_record`` gets each valid record in order. Bytes that hold no valid record are
        skipped: the scan resyncs at the next valid record (its magic, checksum and own
        position all agree) and reports the skipped range to ``on_damage`` before that
        record. Unreadable bytes after the last valid record are a torn write: they are
        truncated (nothing after them can have been acknowledged). The scanned segments
        are marked dirty so that the next sync makes the recovered tail durable.
        """
        pending: list[tuple[int, int]] = []
        last_valid = start
        for seg in self.segments:
            if seg.end <= start and seg is not self.segments[-1]:
                continue
            self._dirty.add(seg.fd)
            for ev in self.scan_segment(seg, max(0, start - seg.base)):
                if isinstance(ev, RecordHead):
                    for a, b in pending:
                        on_damage(a, b)
                    pending.clear()
                    on_record(ev)
                    last_valid = ev.position + ev.size
                else:
                    pending.append(ev)
        if pending:
            cut = max(last_valid, pending[0][0])
            for seg in self.segments:
                if seg.end > cut:
                    keep = max(0, cut - seg.base)
                    log.warning("commit log: truncating a torn tail of segment %s at %d "
                                "(was %d bytes of data)", file_name(seg.base), keep, seg.size)
                    self.files.ftruncate(seg.fd, FILE_HEADER_SIZE + keep)
                    self.files.fsync(seg.fd)
                    seg.size = keep
        return self.end

    def scan_segment(self, seg: Segment, start_off: int = 0, stop_off: int | None = None
                     ) -> Iterator[RecordHead | tuple[int, int]]:
        """Records of ``seg`` from data offset ``start_off``, with damaged ranges between.

        Yields each valid record's head, and ``(start, end)`` positions of every range of
        bytes that holds no valid record (the scan resyncs at the next record magic whose
        record has a valid checksum and claims its own position). Stops at the segment
        end, or at the first record boundary at or after ``stop_off``.
        """
        fs = self.files
        seg_size = seg.size
        buf = b""
        buf_start = off = start_off
        bad: int | None = None
        eof = start_off >= seg_size
        while True:
            if bad is None and (off >= seg_size or (stop_off is not None and off >= stop_off)):
                return
            p = off - buf_start
            try:
                head = check_record(buf, p, seg.base + off)
            except TruncatedRecord:
                if not eof:
                    read_at = buf_start + len(buf)
                    chunk = fs.pread(seg.fd, min(READ_CHUNK, seg_size - read_at),
                                     FILE_HEADER_SIZE + read_at)
                    eof = read_at + len(chunk) >= seg_size or not chunk
                    buf = buf[p:] + chunk
                    buf_start = off
                    continue
            except RecordError:
                pass
            else:
                if bad is not None:
                    yield (seg.base + bad, seg.base + off)
                    bad = None
                yield head
                off += head.size
                continue
            # no valid record at ``off``: look for the next candidate
            if bad is None:
                bad = off
            i = buf.find(_MAGIC, p + 9)  # the magic is byte 8 of a record
            if i >= 0:
                off = buf_start + i - 8
            elif eof:
                yield (seg.base + bad, seg.base + buf_start + len(buf))
                return
            else:
                off = max(off + 1, buf_start + len(buf) - 8)

    # ---------------------------------------------------------------- segments
    def _new_segment(self, base: int) -> Segment:
        """Create the segment file at ``base``; on failure remove it (when possible)."""
        path = os.path.join(self.dir, file_name(base))
        fs = self.files
        fd = fs.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fs.write_all(fd, encode_file_header(LOG_MAGIC, base), 0)
            fs.fsync(fd)
            fs.fsync_dir(self.dir)
        except OSError:
            # an empty file left behind is harmless: ``open`` rewrites its header and the
            # next roll truncates it again
            with contextlib.suppress(OSError):
                fs.close(fd)
            with contextlib.suppress(OSError):
                fs.unlink(path)
            raise
        seg = Segment(base, path, fd, 0)
        self.segments.append(seg)
        return seg

    @property
    def end(self) -> int:
        return self.segments[-1].end

    @property
    def start(self) -> int:
        return self.segments[0].base

    @property
    def room(self) -> int:
        """Bytes that still fit in the active segment."""
        return self.segment_size - self.segments[-1].size

    def roll(self, pending: list[bytes]) -> int:
        """Write ``pending`` to the active segment, start a new one, return its base."""
        if pending:
            self.write(pending)
            pending.clear()
        seg = self.segments[-1]
        self._dirty.add(seg.fd)
        return self._new_segment(seg.end).base

    def write(self, records: list[bytes]) -> None:
        """Append the reserved records to the active segment."""
        seg = self.segments[-1]
        data = b"".join(records)
        # positional writes: the fd's file offset is not the segment end after recovery
        # (the scan uses pread) nor after a truncation of a torn tail
        self.files.write_all(seg.fd, data, FILE_HEADER_SIZE + seg.size)
        seg.size += len(data)
        self._dirty.add(seg.fd)

    def truncate_to(self, position: int) -> None:
        """Undo every write at and after ``position`` (a failed write's rollback).

        Segments starting at or after ``position`` (created by a roll of the failed write)
        are deleted; the segment holding ``position`` is cut there and fsynced, so the
        undone bytes cannot come back after a power cut either. Raises ``OSError`` when the
        file system refuses: the caller must then stop writing.
        """
        fs = self.files
        dropped = False
        while len(self.segments) > 1 and self.segments[-1].base >= position:
            seg = self.segments[-1]
            fs.unlink(seg.path)
            self.segments.pop()
            self._dirty.discard(seg.fd)
            with contextlib.suppress(OSError):
                fs.close(seg.fd)
            dropped = True
        if dropped:
            fs.fsync_dir(self.dir)
        seg = self.segments[-1]
        keep = max(0, position - seg.base)
        fs.ftruncate(seg.fd, FILE_HEADER_SIZE + keep)
        fs.fsync(seg.fd)
        seg.size = keep

    def read(self, position: int, size: int) -> bytes:
        """Read ``size`` bytes at ``position``; the range may cross segment boundaries."""
        out = []
        while size > 0:
            seg = self._find(position)
            n = min(size, seg.end - position)
            out.append(self.files.pread(seg.fd, n, FILE_HEADER_SIZE + position - seg.base))
            position += n
            size -= n
        return out[0] if len(out) == 1 else b"".join(out)

    def lost(self, position: int) -> bool:
        """Whether ``position`` lies in the log's range but in no segment (a lost file)."""
        if not self.start <= position < self.end:
            return False
        try:
            self._find(position)
        except KeyError:
            return True
        return False

    def _find(self, position: int) -> Segment:
        segs = self.segments
        lo, hi = 0, len(segs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if segs[mid].base <= position:
                lo = mid
            else:
                hi = mid - 1
        seg = segs[lo]
        if not seg.base <= position < seg.end:
            raise KeyError(position)
        return seg

    # ---------------------------------------------------------------- durability
    def take_dirty(self) -> list[int]:
        fds = list(self._dirty)
        self._dirty.clear()
        return fds

    def sync(self) -> None:
        for fd in self.take_dirty():
            self.files.fsync(fd)

    # ---------------------------------------------------------------- retention
    def delete_segments(self, keep: Callable[[Segment, int], bool]) -> int:
        """Delete leading segments while ``keep(segment, total_bytes)`` is False.

        The active segment is never deleted. Returns the new start position.
        """
        total = sum(s.size for s in self.segments)
        while len(self.segments) > 1 and not keep(self.segments[0], total):
            seg = self.segments.pop(0)
            total -= seg.size
            self.files.close(seg.fd)
            self._dirty.discard(seg.fd)
            self.files.unlink(seg.path)
            log.info("commit log: retention deleted segment %s", file_name(seg.base))
        return self.start

    def close(self) -> None:
        for seg in self.segments:
            self.files.close(seg.fd)
        self.segments.clear()


def _segment_names(directory: str, files: FileOps) -> list[str]:
    return sorted(n for n in files.listdir(directory) if n.isdigit() and len(n) == 20)


def first_segment_base(directory: str, files: FileOps = OS_FILES) -> int:
    """Base position of the oldest segment file in ``directory`` (0 when there is none)."""
    names = _segment_names(directory, files)
    return int(names[0]) if names else 0
