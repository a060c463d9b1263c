"""A file layer that fails on purpose: the Nth call of a chosen operation raises ``OSError``.

``FaultFiles`` is a ``FileOps`` on real files. ``arm(op, nth, err, where)`` makes the
``nth`` call (counted from now) of operation ``op`` whose path matches ``where`` raise
``OSError(err)``, ``times`` times in a row (``times=None``: until ``disarm``). Operations on
a file descriptor match the path it was opened with. A failing ``pwrite`` first writes
half of its bytes, as a write that ran out of space half-way does. ``usage`` is what
``disk_usage`` reports when set (a disk filling up without filling one).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass

from onceq.storage.files import FileOps

Where = str | Callable[[str], bool] | None


@dataclass
class Fault:
    op: str
    nth: int
    err: int
    where: Where
    times: int | None
    seen: int = 0
    raised: int = 0

    def matches(self, op: str, path: str) -> bool:
        if op != self.op:
            return False
        if self.where is None:
            return True
        if callable(self.where):
            return self.where(path)
        return self.where in path

    def hit(self) -> bool:
        """Count a matching call; True when this one must fail."""
        self.seen += 1
        if self.seen < self.nth:
            return False
        if self.times is not None and self.raised >= self.times:
            return False
        self.raised += 1
        return True


class FaultFiles(FileOps):
    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.faults: list[Fault] = []
        self.usage: tuple[int, int] | None = None  # (total, available) when faked

    # ---------------------------------------------------------------- control
    def arm(self, op: str, nth: int = 1, err: int = errno.EIO, where: Where = None,
            times: int | None = 1) -> Fault:
        fault = Fault(op, nth, err, where, times)
        self.faults.append(fault)
        return fault

    def disarm(self) -> None:
        self.faults.clear()

    @property
    def raised(self) -> int:
        return sum(f.raised for f in self.faults)

    def _check(self, op: str, path: str) -> None:
        for fault in self.faults:
            if fault.matches(op, path) and fault.hit():
                raise OSError(fault.err, f"injected {os.strerror(fault.err)}", path)

    def _path(self, fd: int) -> str:
        return self.paths.get(fd, "")

    # ---------------------------------------------------------------- operations
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._check("open", path)
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        self.paths.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        try:
            self._check("pwrite", self._path(fd))
        except OSError:
            half = len(data) // 2
            if half:
                super().pwrite(fd, data[:half], offset)
            raise
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._check("fsync", self._path(fd))
        super().fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        self._check("ftruncate", self._path(fd))
        super().ftruncate(fd, size)

    def unlink(self, path: str) -> None:
        self._check("unlink", path)
        super().unlink(path)

    def replace(self, src: str, dst: str) -> None:
        self._check("replace", dst)
        super().replace(src, dst)

    def makedirs(self, path: str) -> None:
        self._check("makedirs", path)
        super().makedirs(path)

    def rmdir(self, path: str) -> None:
        self._check("rmdir", path)
        super().rmdir(path)

    def listdir(self, path: str) -> list[str]:
        self._check("listdir", path)
        return super().listdir(path)

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        super().fsync_dir(path)

    def disk_usage(self, path: str) -> tuple[int, int]:
        if self.usage is not None:
            return self.usage
        return super().disk_usage(path)


class CountingFiles(FileOps):
    """The real file layer, counting the bytes read (what recovery had to read)."""

    def __init__(self) -> None:
        self.read = 0

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = super().pread(fd, size, offset)
        self.read += len(data)
        return data
