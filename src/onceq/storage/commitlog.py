"""The commit log: append-only segment files named by their base position.

Positions are global byte positions across segments (segment base + offset in the segment's
data area). A segment holds at most ``segment_size`` data bytes; a record never spans two
segments. Writes go through ``pwrite`` into the page cache; ``sync()`` fsyncs the
segments touched since the last sync. Reads use ``pread``. File calls go through ``FileOps``.

Only the active (last) segment keeps a descriptor of its own; older segments are sealed and
opened on demand through the store's bounded cache of open files (``OpenFiles``), so the
descriptors held do not grow with the data kept. A sealed segment that was written and not
yet fsynced is fsynced by path.

A power cut must cost only a suffix of the log: segments are fsynced in the order of their
positions, one fsync sequence at a time, so no byte becomes durable through an fsync before
every earlier byte has; and at open, segments that hold no record after a segment that lost
its tail (in the log after the checkpoint) are the remains of that lost tail, not a gap.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..log.record import (
    RECORD_MAGICS,
    RecordError,
    RecordHead,
    TruncatedRecord,
    check_record,
)
from ..log.segment import (
    FILE_HEADER_SIZE,
    LOG_FORMAT_VERSION,
    LOG_MAGIC,
    FileHeaderError,
    decode_file_header,
    encode_file_header,
    file_name,
)
from .files import OS_FILES, FileOps
from .openfiles import OpenFiles, fsync_paths

log = logging.getLogger("onceq.storage")

READ_CHUNK = 8 * 1024 * 1024
_MAGIC = re.compile(b"[%s]" % bytes(RECORD_MAGICS))  # byte 8 of either kind of record
# one fsync sequence of commit-log segments at a time (the flush service's, off the loop,
# and a sync on the loop): a later segment's records never reach the disk through one
# sequence while an earlier segment's tail waits in another
_SYNC_LOCK = threading.Lock()


@dataclass(slots=True)
class Segment:
    base: int
    path: str
    fd: int | None  # own descriptor of the active segment; None once sealed
    size: int  # data bytes (excluding the file header)
    mtime: float = 0.0  # of a sealed segment (retention by age)

    @property
    def end(self) -> int:
        return self.base + self.size


class CommitLog:
    def __init__(self, directory: str, segment_size: int, files: FileOps = OS_FILES,
                 open_files: OpenFiles | None = None) -> None:
        if segment_size < 4096:
            raise ValueError("segment size must be at least 4096 bytes")
        self.dir = directory
        self.files = files
        self.open_files = open_files if open_files is not None else OpenFiles(files, 16)
        self.segment_size = segment_size
        self.segments: list[Segment] = []
        self._dirty: set[int] = set()  # active segment's fd, written since the last sync
        self._dirty_sealed: set[str] = set()  # sealed segments written since the last sync
        # descriptors of segments sealed since the last flush: a flush in flight may be
        # fsyncing them, so they are closed only by ``release_retired`` after it
        self._retired: list[int] = []
        self.syncing = False  # an fsync of ``take_dirty``'s descriptors runs off the loop
        files.makedirs(directory)

    # ---------------------------------------------------------------- recovery
    def open(self, empty_base: int = 0, tail_from: int | None = None
             ) -> list[tuple[int, int]]:
        """Open every segment without reading its records; return the missing ranges.

        Older segments are trusted at start (their records are checked on read and by
        ``onceq broker verify``), so opening costs the same whatever the data size. A
        damaged file header is rewritten from the file name (records carry their own
        position and checksum). A segment missing between two others leaves a gap of
        positions, returned as ``(start, end)`` ranges; later segments are kept.

        ``tail_from``: the position from which the log is not known durable (the
        checkpoint). A segment that ends there or later before the next segment's base
        lost its tail in a power cut; when every later segment holds no record (a roll
        made them durable, empty, before the tail reached the disk), they are removed: the
        log ends where the lost tail starts, with no gap.
        """
        fs = self.files
        versions: dict[int, int] = {}
        for name in _segment_names(self.dir, fs):
            path = os.path.join(self.dir, name)
            base = int(name)
            fd = fs.open(path, os.O_RDWR)
            try:
                versions[base] = decode_file_header(fs.pread(fd, FILE_HEADER_SIZE, 0),
                                                    LOG_MAGIC, base)
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
            size = max(0, fs.size(fd) - FILE_HEADER_SIZE)
            if self.segments:  # the previous one is not the last: sealed
                prev = self.segments[-1]
                fs.close(prev.fd)
                prev.fd = None
            self.segments.append(Segment(base, path, fd, size, fs.mtime(fd)))
        if tail_from is not None:
            self._drop_after_lost_tail(tail_from)
        if not self.segments:
            self._new_segment(empty_base)
        elif versions.get(self.segments[-1].base, LOG_FORMAT_VERSION) < LOG_FORMAT_VERSION:
            # the active segment of an older release: it may take batch records now
            active = self.segments[-1]
            fs.write_all(active.fd, encode_file_header(LOG_MAGIC, active.base), 0)
            fs.fsync(active.fd)
        gaps: list[tuple[int, int]] = []
        for prev, seg in zip(self.segments, self.segments[1:], strict=False):
            if seg.base > prev.end:
                gaps.append((prev.end, seg.base))
                log.error("commit log: positions [%d, %d) are missing (a segment file was "
                          "lost); later segments are kept", prev.end, seg.base)
        return gaps

    def _drop_after_lost_tail(self, tail_from: int) -> None:
        """Remove the segments that hold no record after the first segment, at or after
        ``tail_from``, that ends before the next one starts (see ``open``)."""
        segs = self.segments
        i = next((i for i in range(1, len(segs))
                  if segs[i].base > segs[i - 1].end >= tail_from), None)
        if i is None or any(isinstance(ev, RecordHead) for seg in segs[i:]
                            for ev in self.scan_segment(seg)):
            return
        last = segs[i - 1]
        dropped = segs[i:]
        log.warning("commit log: segment %s lost its tail after position %d (%d bytes, a "
                    "power cut); %d later segment(s) without records removed",
                    file_name(last.base), last.end, dropped[0].base - last.end, len(dropped))
        for seg in dropped:
            if seg.fd is not None:
                self.files.close(seg.fd)
                seg.fd = None
            self.open_files.close(seg.path)
            self.files.unlink(seg.path)
        del segs[i:]
        self.files.fsync_dir(self.dir)
        self.open_files.close(last.path)
        last.fd = self.files.open(last.path, os.O_RDWR)  # the active segment again

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
            self._mark_dirty(seg)
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
                    log.warning("commit log: truncating a torn tail of segment %s at %d "
                                "(was %d bytes of data)", file_name(seg.base),
                                max(0, cut - seg.base), seg.size)
            # later segments go too: the log ends at ``cut`` with no gap before its end
            self.truncate_to(cut)
        return self.end

    def _fd(self, seg: Segment) -> int:
        """A descriptor of ``seg`` (a sealed one's from the cache: use it at once)."""
        return seg.fd if seg.fd is not None else self.open_files.get(seg.path)

    def _mark_dirty(self, seg: Segment) -> None:
        if seg.fd is not None:
            self._dirty.add(seg.fd)
        else:
            self._dirty_sealed.add(seg.path)

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
                    chunk = fs.pread(self._fd(seg), min(READ_CHUNK, seg_size - read_at),
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
            m = _MAGIC.search(buf, p + 9)  # the magic is byte 8 of a record
            i = m.start() if m is not None else -1
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
        new = self._new_segment(seg.end)
        self._seal(seg)
        return new.base

    def _seal(self, seg: Segment) -> None:
        """The active segment became an older one: give up its own descriptor."""
        fd = seg.fd
        if fd is None:
            return
        seg.mtime = self.files.mtime(fd)
        if fd in self._dirty:  # its last writes are fsynced by path
            self._dirty.discard(fd)
            self._dirty_sealed.add(seg.path)
        seg.fd = None
        self._retired.append(fd)
        self.release_retired()

    def release_retired(self) -> None:
        """Close the descriptors of sealed or removed segments, unless a flush may be
        fsyncing them right now (then the next call does)."""
        if self.syncing:
            return
        retired, self._retired = self._retired, []
        for fd in retired:
            with contextlib.suppress(OSError):
                self.files.close(fd)

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
            self._forget(seg)
            dropped = True
        if dropped:
            fs.fsync_dir(self.dir)
        seg = self.segments[-1]
        if seg.fd is None:  # a sealed segment is the active one again
            self.open_files.close(seg.path)
            self._dirty_sealed.discard(seg.path)
            seg.fd = fs.open(seg.path, os.O_RDWR)
        keep = max(0, position - seg.base)
        fs.ftruncate(seg.fd, FILE_HEADER_SIZE + keep)
        fs.fsync(seg.fd)
        seg.size = keep

    def _forget(self, seg: Segment) -> None:
        """Drop every descriptor and dirty mark of a segment going away."""
        if seg.fd is not None:
            self._dirty.discard(seg.fd)
            self._retired.append(seg.fd)  # a flush in flight may hold it
            seg.fd = None
        self._dirty_sealed.discard(seg.path)
        self.open_files.close(seg.path)

    def read(self, position: int, size: int) -> bytes:
        """Read ``size`` bytes at ``position``; the range may cross segment boundaries."""
        out = []
        while size > 0:
            seg = self._find(position)
            n = min(size, seg.end - position)
            out.append(self.files.pread(self._fd(seg), n,
                                        FILE_HEADER_SIZE + position - seg.base))
            position += n
            size -= n
        return out[0] if len(out) == 1 else b"".join(out)

    def read_segment(self, seg: Segment, offset: int, size: int) -> bytes:
        """Up to ``size`` data bytes of ``seg`` from data offset ``offset``."""
        return self.files.pread(self._fd(seg), size, FILE_HEADER_SIZE + offset)

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
    def take_dirty(self) -> list[int | str]:
        """What was written since the last call, for ``fsync_all``, in log order: the paths
        of sealed segments by position, then the active segment's descriptor (a power cut
        during the fsyncs then loses a suffix of the log, never bytes before kept ones)."""
        out: list[int | str] = [*sorted(self._dirty_sealed), *self._dirty]
        self._dirty.clear()
        self._dirty_sealed.clear()
        return out

    def sync(self) -> None:
        fsync_all(self.files, self.take_dirty())
        self.release_retired()

    def mtime(self, seg: Segment) -> float:
        return self.files.mtime(seg.fd) if seg.fd is not None else seg.mtime

    # ---------------------------------------------------------------- retention
    def delete_segments(self, keep: Callable[[Segment, int], bool]) -> int:
        """Delete leading segments while ``keep(segment, total_bytes)`` is False.

        The active segment is never deleted. Returns the new start position.
        """
        total = sum(s.size for s in self.segments)
        while len(self.segments) > 1 and not keep(self.segments[0], total):
            seg = self.segments.pop(0)
            total -= seg.size
            self._forget(seg)
            self.files.unlink(seg.path)
            log.info("commit log: retention deleted segment %s", file_name(seg.base))
        self.release_retired()
        return self.start

    def close(self) -> None:
        for seg in self.segments:
            self._forget(seg)
        self.segments.clear()
        self.release_retired()


def fsync_all(files: FileOps, targets: list[int | str]) -> None:
    """Fsync what ``take_dirty`` returned, in its order: sealed segments by path, then
    descriptors; one call at a time (``_SYNC_LOCK``), so bytes reach the disk in log order.

    A descriptor closed meanwhile (``EBADF``) or a file deleted meanwhile belongs to a
    segment that retention or a rollback removed: nothing to sync."""
    with _SYNC_LOCK:
        for t in targets:
            if isinstance(t, str):
                fsync_paths(files, [t])
                continue
            try:
                files.fsync(t)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise  # a real I/O error: the bytes are not known to be on disk


def _segment_names(directory: str, files: FileOps) -> list[str]:
    return sorted(n for n in files.listdir(directory) if n.isdigit() and len(n) == 20)


def first_segment_base(directory: str, files: FileOps = OS_FILES) -> int:
    """Base position of the oldest segment file in ``directory`` (0 when there is none)."""
    names = _segment_names(directory, files)
    return int(names[0]) if names else 0
