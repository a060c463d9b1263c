"""A file layer that models a power cut: only what was fsynced survives.

``PowerCutFiles`` is a ``FileOps`` that works on real files and remembers, for each file,
its content at the last ``fsync``. ``cut_power()`` puts every file back to that content
(a file never fsynced comes back empty), as a machine that lost power would find its disk.
A killed process (SIGKILL) loses nothing: that is dropping the store without closing it.

Directory entries are taken as durable (creates, renames and unlinks are not undone), and
``write_atomic`` renames a fsynced temp file, so renamed files keep their fsynced content.
"""

from __future__ import annotations

import os

from onceq.storage.files import FileOps


class PowerCutFiles(FileOps):
    def __init__(self) -> None:
        self.paths: dict[int, str] = {}  # open fd -> path
        self.synced: dict[str, bytes] = {}  # path -> content at its last fsync
        self.fsyncs = 0

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        path = os.path.abspath(path)
        self.paths[fd] = path
        if flags & os.O_CREAT and path not in self.synced:
            self.synced[path] = b""  # created now: nothing durable yet
        elif path not in self.synced:
            self.synced[path] = _content(path)  # existed before this model started
        return fd

    def close(self, fd: int) -> None:
        self.paths.pop(fd, None)
        super().close(fd)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self.fsyncs += 1
        self.synced[self.paths[fd]] = _content(self.paths[fd])

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        self.synced[dst] = self.synced.pop(src, b"")

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self.synced.pop(os.path.abspath(path), None)

    def rmtree(self, path: str) -> None:
        super().rmtree(path)
        root = os.path.abspath(path) + os.sep
        for p in [p for p in self.synced if p.startswith(root)]:
            del self.synced[p]

    def unsynced_bytes(self) -> int:
        """Bytes that differ from the fsynced content, over every file."""
        total = 0
        for path, data in self.synced.items():
            now = _content(path)
            if now != data:
                total += max(len(now), len(data)) - sum(
                    1 for a, b in zip(now, data, strict=False) if a == b)
        return total

    def cut_power(self) -> None:
        """Put every known file back to its fsynced content. Open fds must be dropped."""
        for path, data in self.synced.items():
            if os.path.exists(path):
                with open(path, "wb") as f:
                    f.write(data)
        self.paths.clear()


def _content(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
