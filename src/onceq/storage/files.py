"""The file-system calls of the storage layer, behind one small object.

Every storage module does its file I/O through a ``FileOps`` passed in (default: the real
``os`` calls), so tests can inject faults at any step (an ``OSError`` from a chosen call, a
full disk) or model a power cut (keep only the bytes that were fsynced) without patching
``os``.
"""

from __future__ import annotations

import os
import shutil


class FileOps:
    """Thin wrappers over ``os``; subclass and override to inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def mtime(self, fd: int) -> float:
        return os.fstat(fd).st_mtime

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def read_file(self, path: str) -> bytes:
        """The whole content of ``path`` (FileNotFoundError when it does not exist)."""
        with open(path, "rb") as f:
            return f.read()

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def disk_usage(self, path: str) -> tuple[int, int]:
        """``(total, available)`` bytes of the file system holding ``path``."""
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def write_all(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        """``pwrite`` until every byte is written."""
        view = memoryview(data)
        while view:
            n = self.pwrite(fd, view, offset)
            view = view[n:]
            offset += n


OS_FILES = FileOps()
