"""The commit log: append-only segment files named by their base position.

Positions are global byte positions across segments (segment base + offset in the segment's
data area). A segment holds at most ``segment_size`` data bytes; a record never spans two
segments. Writes go through ``pwrite`` into the page cache; ``sync()`` fsyncs the
segments touched since the last sync. Reads use ``pread``. File calls go through ``FileOps``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..log.record import RecordError, RecordHead, TruncatedRecord, check_record
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
    def recover(self, on_record: Callable[[RecordHead], None]) -> int:
        """Open the segments, keep the longest valid prefix, truncate the rest.

        Calls ``on_record`` for every valid record in order; returns the end position.
        """
        names = _segment_names(self.dir, self.files)
        expect = int(names[0]) if names else 0
        broken = False
        fs = self.files
        for name in names:
            path = os.path.join(self.dir, name)
            base = int(name)
            if broken or base != expect:
                log.warning("commit log: removing segment %s after the valid prefix", name)
                fs.unlink(path)
                broken = True
                continue
            fd = fs.open(path, os.O_RDWR)
            try:
                decode_file_header(fs.pread(fd, FILE_HEADER_SIZE, 0), LOG_MAGIC, base)
            except FileHeaderError as exc:
                fs.close(fd)
                log.warning("commit log: segment %s unusable (%s), removed", name, exc)
                fs.unlink(path)
                broken = True
                continue
            try:
                valid = self._scan_segment(fd, base, on_record)
            except BaseException:
                fs.close(fd)
                raise
            file_size = fs.size(fd)
            if FILE_HEADER_SIZE + valid < file_size:
                log.warning(
                    "commit log: truncating segment %s at %d (was %d bytes of data)",
                    name, valid, file_size - FILE_HEADER_SIZE,
                )
                fs.ftruncate(fd, FILE_HEADER_SIZE + valid)
                fs.fsync(fd)
                broken = True
            seg = Segment(base, path, fd, valid, fs.mtime(fd))
            self.segments.append(seg)
            expect = base + valid
        if not self.segments:
            self._new_segment(expect)
        return self.end

    def _scan_segment(self, fd: int, base: int, on_record: Callable[[RecordHead], None]) -> int:
        """Return how many data bytes of the segment are valid records."""
        valid = 0
        buf = b""
        buf_start = 0  # data offset of buf[0]
        file_pos = FILE_HEADER_SIZE
        eof = False
        while True:
            p = valid - buf_start
            try:
                head = check_record(buf, p, base + valid)
            except TruncatedRecord:
                if eof:
                    return valid
                chunk = self.files.pread(fd, READ_CHUNK, file_pos)
                eof = len(chunk) < READ_CHUNK
                file_pos += len(chunk)
                buf = buf[p:] + chunk
                buf_start = valid
                continue
            except RecordError:
                return valid
            on_record(head)
            valid += head.size

    # ---------------------------------------------------------------- segments
    def _new_segment(self, base: int) -> Segment:
        path = os.path.join(self.dir, file_name(base))
        fs = self.files
        fd = fs.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fs.write_all(fd, encode_file_header(LOG_MAGIC, base), 0)
        fs.fsync(fd)
        fs.fsync_dir(self.dir)
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
