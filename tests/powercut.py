"""A file layer that models a power cut: only what was fsynced survives.

``PowerCutFiles`` is a ``FileOps`` that works on real files and remembers, for each file,
its content at the last ``fsync``. ``cut_power()`` puts every file back to that content
(a file never fsynced comes back empty), as a machine that lost power would find its disk.
A killed process (SIGKILL) loses nothing: that is dropping the store without closing it.

Directory entries are taken as durable (creates, renames and unlinks are not undone), and
``write_atomic`` renames a fsynced temp file, so renamed files keep their fsynced content.

**Where the cut falls.** Every change of what the disk holds durably is an event: a file
fsync, a rename, an unlink. ``cut_after=k`` (or ``cut_now()``) takes the power away after
the ``k``-th event: later fsyncs, renames and unlinks still act on the files (the process
does not know yet), but ``cut_power()`` restores the disk as it was at the cut (files
created after it disappear, files removed after it come back). So a cut can fall between
any two fsyncs, also between the fsyncs of one flush or checkpoint. ``after_fsync`` runs a
callback after each fsync, so a test can interleave the loop's work with a flush or a
checkpoint that runs off the loop. The model is thread-safe: fsyncs may run in threads.

``keep="size"`` records only the size of a file larger than 64 KiB at its fsync and cuts
it back to that size (smaller files keep their content, so files replaced by a rename come
back whole): exact for large files that are only appended to (segments, index files), and
cheap enough for data sets of gigabytes (``keep="content"``, the default, holds every
file's content).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from onceq.storage.files import FileOps

Durable = bytes | int  # a file's durable content, or its durable size (keep="size")
SIZE_ONLY_ABOVE = 64 * 1024  # keep="size": larger files are tracked by their size


class PowerCutFiles(FileOps):
    def __init__(self, cut_after: int | None = None, keep: str = "content") -> None:
        if keep not in ("content", "size"):
            raise ValueError(keep)
        self.keep = keep
        self.paths: dict[int, str] = {}  # open fd -> path
        self.synced: dict[str, Durable] = {}  # path -> durable content (or size) now
        self.fsyncs = 0
        self.events = 0  # fsyncs, renames and unlinks so far
        self.cut_after = cut_after
        self.cut_at: dict[str, Durable] | None = None  # the disk at the cut, once it fell
        self.after_fsync: Callable[[str], None] | None = None
        self._lock = threading.RLock()
        if cut_after is not None and cut_after <= 0:
            self.cut_at = {}

    # ---------------------------------------------------------------- the cut
    @property
    def cut(self) -> bool:
        """Whether the power is gone already (later writes are lost)."""
        return self.cut_at is not None

    def cut_now(self) -> None:
        """The power goes now: what is durable at this moment is what a restart finds."""
        with self._lock:
            if self.cut_at is None:
                self.cut_at = dict(self.synced)

    def _event(self) -> None:
        """Count a durable change (lock held); the cut falls after the ``cut_after``-th."""
        self.events += 1
        if self.cut_at is None and self.cut_after is not None and (
                self.events >= self.cut_after):
            self.cut_at = dict(self.synced)

    def _durable(self, path: str) -> Durable:
        if self.keep == "size":
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                return b""
            if size > SIZE_ONLY_ABOVE:
                return size
        return _content(path)

    # ---------------------------------------------------------------- FileOps
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        path = os.path.abspath(path)
        self.paths[fd] = path
        with self._lock:
            if path not in self.synced:
                # created now: nothing durable yet; else it existed before the model started
                now = b"" if flags & os.O_CREAT else self._durable(path)
                self.synced[path] = now
                if self.cut_at is not None and not flags & os.O_CREAT:
                    self.cut_at[path] = now
        return fd

    def close(self, fd: int) -> None:
        self.paths.pop(fd, None)
        super().close(fd)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        path = self.paths[fd]
        with self._lock:
            self.fsyncs += 1
            self.synced[path] = self._durable(path)
            self._event()
        hook = self.after_fsync
        if hook is not None:
            hook(path)

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        with self._lock:
            self.synced[dst] = self.synced.pop(src, b"")
            self._event()

    def unlink(self, path: str) -> None:
        super().unlink(path)
        with self._lock:
            self.synced.pop(os.path.abspath(path), None)
            self._event()

    def rmtree(self, path: str) -> None:
        super().rmtree(path)
        root = os.path.abspath(path) + os.sep
        with self._lock:
            for p in [p for p in self.synced if p.startswith(root)]:
                del self.synced[p]
            self._event()

    # ---------------------------------------------------------------- inspection
    def unsynced_bytes(self) -> int:
        """Bytes that differ from the fsynced content, over every file."""
        total = 0
        for path, data in self.synced.items():
            now = _content(path)
            if isinstance(data, int):
                total += abs(len(now) - data)
                continue
            if now != data:
                total += max(len(now), len(data)) - sum(
                    1 for a, b in zip(now, data, strict=False) if a == b)
        return total

    def cut_power(self) -> None:
        """Put every known file back to its content at the cut (at the last fsync when no
        cut fell earlier). Open fds must be dropped. The model then goes on from there."""
        with self._lock:
            disk = self.cut_at if self.cut_at is not None else self.synced
            for path in list(self.synced):
                if path not in disk and os.path.exists(path):
                    os.unlink(path)  # created after the cut
            for path, data in disk.items():
                if isinstance(data, int):
                    if os.path.exists(path):
                        os.truncate(path, min(data, os.path.getsize(path)))
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            self.synced = dict(disk)
            self.cut_at = None
            self.cut_after = None
            self.paths.clear()


def _content(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
