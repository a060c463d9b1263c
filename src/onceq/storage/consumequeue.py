"""Per-queue consume-queue index: fixed-size entries in files of ``entries_per_file``.

Entry ``k`` of a queue (queue offset ``k``) lives in the file whose base offset is
``k - k % entries_per_file``. An entry is (commit-log position, size, tag hash, store
timestamp). The index is derived data: recovery rebuilds it from the commit log.
Index files are opened through a bounded cache shared by every queue (``OpenFiles``), so
the number of open descriptors does not grow with the number of queues.
"""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_left

from ..log.segment import (
    FILE_HEADER_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_MAGIC,
    FileHeaderError,
    decode_file_header,
    encode_file_header,
    file_name,
)
from .openfiles import OpenFiles


class ConsumeQueue:
    __slots__ = ("_bases", "_dirty", "_open", "_paths", "dir", "files", "lost_entries",
                 "lost_tail", "max_offset", "min_offset", "per_file")

    def __init__(self, directory: str, entries_per_file: int, open_files: OpenFiles) -> None:
        self.dir = directory
        self.files = files = open_files.files
        self.per_file = entries_per_file
        self._open = open_files  # shared by every queue of the store
        self._bases: set[int] = set()  # base offsets of the index files
        self._paths: dict[int, str] = {}  # file base offset -> path
        self._dirty: set[str] = set()  # paths written since the last dirty_paths()
        self.min_offset = 0
        self.max_offset = 0  # next offset to be written
        self.lost_entries = False  # ``load`` dropped entries before kept ones: damage
        self.lost_tail = False  # ``load`` dropped the last entries (a power cut, or damage)
        files.makedirs(directory)

    def load(self) -> None:
        """Open existing files; drop a torn trailing partial entry; find min/max offsets.

        Files that cannot continue the index are removed: after a power cut the last ones
        may be short or empty (their entries past the last checkpoint come back from the
        log: ``lost_tail``); a file lost or damaged before a kept one is damage
        (``lost_entries``)."""
        fs = self.files
        bases = sorted(int(n) for n in fs.listdir(self.dir) if n.isdigit() and len(n) == 20)
        good: list[int] = []
        dropped: list[int] = []
        for base in bases:
            path = os.path.join(self.dir, file_name(base))
            if base % self.per_file or (good and base != good[-1] + self.per_file):
                fs.unlink(path)
                dropped.append(base)
                continue
            fd = self._open.get(path)
            try:
                decode_file_header(fs.pread(fd, FILE_HEADER_SIZE, 0), INDEX_MAGIC, base)
            except FileHeaderError:
                self._open.close(path)
                fs.unlink(path)
                dropped.append(base)
                continue
            self._bases.add(base)
            self._paths[base] = path
            good.append(base)
        self.lost_tail = bool(dropped)
        self.lost_entries = bool(good) and any(b < good[-1] for b in dropped)
        # only the last file may be partial; a short earlier file ends the index there
        for base in good[:-1]:
            if self._entries_in(base) < self.per_file:
                self._cut(base + self._entries_in(base))
                self.lost_tail = True
                break
        if not self._bases:
            self.min_offset = self.max_offset = 0
            return
        last = max(self._bases)
        self.min_offset = min(self._bases)
        self.max_offset = last + self._entries_in(last)
        # a queue restarted at k > 0 leaves zero-filled entries before k in its first file
        # (only there: a zeroed entry further on is damage, repaired on read)
        if self.max_offset > self.min_offset and self.entry(self.min_offset)[1] == 0:
            first_end = min(self.max_offset, self.min_offset + self.per_file)
            saved, self.max_offset = self.max_offset, first_end
            self.min_offset = self.first_offset_where(1, 1)
            self.max_offset = saved

    def _path(self, base: int) -> str:
        path = self._paths.get(base)
        if path is None:
            path = self._paths[base] = os.path.join(self.dir, file_name(base))
        return path

    def _fd(self, base: int) -> int:
        """An open descriptor of the index file at ``base`` (use it at once)."""
        return self._open.get(self._path(base))

    def _entries_in(self, base: int) -> int:
        size = self.files.size(self._fd(base)) - FILE_HEADER_SIZE
        return min(max(0, size) // INDEX_ENTRY_SIZE, self.per_file)

    def reset(self, offset: int) -> None:
        """Drop every entry and restart the queue at ``offset``."""
        self._empty_at(offset)

    def _empty_at(self, offset: int) -> None:
        """Remove every file; leave an empty queue whose next offset is ``offset``.

        An empty queue at ``offset > 0`` keeps one file holding ``offset - base`` zero-filled
        (never valid) entries, so that ``load`` finds the same next offset after a restart
        and the queue's offsets are never reused.
        """
        for base in list(self._bases):
            self._remove(base)
        if offset > 0:
            base = offset - offset % self.per_file
            fd = self._create(base)
            self.files.ftruncate(fd, FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE)
        self.min_offset = self.max_offset = offset

    # ---------------------------------------------------------------- writes
    def append(self, entries: bytes, count: int) -> None:
        """Append ``count`` packed entries starting at ``max_offset``."""
        offset = self.max_offset
        view = memoryview(entries)
        while count:
            base = offset - offset % self.per_file
            fd = self._fd(base) if base in self._bases else self._create(base)
            room = base + self.per_file - offset
            n = min(room, count)
            chunk = view[: n * INDEX_ENTRY_SIZE]
            self.files.write_all(fd, chunk, FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE)
            self._dirty.add(self._paths[base])
            view = view[n * INDEX_ENTRY_SIZE:]
            offset += n
            count -= n
        self.max_offset = offset

    def write_entry(self, offset: int, entry: bytes) -> None:
        """Overwrite the entry of ``offset`` (in [min, max)): a repaired or damaged entry."""
        base = offset - offset % self.per_file
        if base not in self._bases:
            raise KeyError(offset)
        self.files.write_all(self._fd(base), entry,
                             FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE)
        self._dirty.add(self._paths[base])

    def _create(self, base: int) -> int:
        path = self._path(base)
        fd = self._open.create(path)
        try:
            self.files.write_all(fd, encode_file_header(INDEX_MAGIC, base), 0)
        except OSError:
            # a file with a partial header would cost a rebuild of every index at start
            self._open.close(path)
            with contextlib.suppress(OSError):
                self.files.unlink(path)
            raise
        self._bases.add(base)
        self._dirty.add(path)
        return fd

    def truncate(self, offset: int) -> None:
        """Remove entries at and after ``offset`` (``offset`` <= min_offset empties it).

        An emptied queue restarts at its ``min_offset``: offsets below it were handed out
        already and are never reused.
        """
        if offset >= self.max_offset:
            return
        if offset <= self.min_offset:
            self._empty_at(self.min_offset)
            return
        self._cut(offset)
        self.max_offset = offset

    def rollback(self, offset: int) -> None:
        """Undo the entries appended at and after ``offset`` (a failed write's), keeping
        ``min_offset``; index files created for them are removed. Raises ``OSError`` when
        the file system refuses."""
        self._cut(offset)
        self.max_offset = offset

    def _cut(self, offset: int) -> None:
        """Delete the files after ``offset``'s file and cut that one at ``offset``."""
        keep = offset - offset % self.per_file
        for base in list(self._bases):
            if base > keep:
                self._remove(base)
            elif base == keep:
                self.files.ftruncate(self._fd(base),
                                     FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE)
                self._dirty.add(self._paths[base])

    # ---------------------------------------------------------------- reads
    def read(self, offset: int, count: int) -> bytes:
        """Packed entries for [offset, offset+count) clipped to the queue's range."""
        offset = max(offset, self.min_offset)
        count = min(count, self.max_offset - offset)
        out: list[bytes] = []
        while count > 0:
            base = offset - offset % self.per_file
            n = min(count, base + self.per_file - offset)
            out.append(self.files.pread(
                self._fd(base), n * INDEX_ENTRY_SIZE,
                FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE,
            ))
            offset += n
            count -= n
        return out[0] if len(out) == 1 else b"".join(out)

    def entry(self, offset: int) -> tuple[int, int, int, int]:
        raw = self.read(offset, 1)
        if len(raw) != INDEX_ENTRY_SIZE:
            raise KeyError(offset)
        return INDEX_ENTRY.unpack(raw)

    def first_offset_where(self, pred_index: int, value: int) -> int:
        """Smallest offset in [min, max) whose entry field ``pred_index`` >= value (else max)."""

        class _View:
            def __len__(_s) -> int:
                return self.max_offset - self.min_offset

            def __getitem__(_s, i: int) -> int:
                return self.entry(self.min_offset + i)[pred_index]

        return self.min_offset + bisect_left(_View(), value)

    # ---------------------------------------------------------------- retention
    def drop_below_position(self, log_start: int) -> None:
        """Advance ``min_offset`` past entries whose record was deleted by retention."""
        if self.max_offset == self.min_offset:
            return
        new_min = self.first_offset_where(0, log_start)
        if new_min <= self.min_offset:
            return
        self.min_offset = new_min
        last = max(self._bases)  # kept: it tells ``load`` where the queue ends
        for base in sorted(self._bases):
            if base + self.per_file <= new_min and base != last:
                self._remove(base)

    def _remove(self, base: int) -> None:
        """Close and delete the index file at ``base``."""
        path = self._path(base)
        self._bases.discard(base)
        self._dirty.discard(path)
        self._open.close(path)
        self.files.unlink(path)
        del self._paths[base]

    def dirty_paths(self) -> list[str]:
        """The files written since the last call (to fsync before a checkpoint)."""
        paths = list(self._dirty)
        self._dirty.clear()
        return paths

    def close(self) -> None:
        for base in self._bases:
            self._open.close(self._path(base))
        self._bases.clear()
        self._paths.clear()
        self._dirty.clear()

    def destroy(self) -> None:
        self.close()
        for n in self.files.listdir(self.dir):
            self.files.unlink(os.path.join(self.dir, n))
        self.files.rmdir(self.dir)
