"""A bounded cache of open index files, so the broker's descriptors do not grow with queues.

Every consume queue keeps one index file per ``index_entries_per_file`` entries; a broker
with 10,000 queues would need 10,000 descriptors if each stayed open (RocketMQ maps and
closes its files; NATS keeps an LRU of open block files). Index files are opened here on
demand and the least recently used one is closed above ``capacity``. Nothing is lost by
closing a file that was written and not yet fsynced: its pages stay in the page cache, and
the checkpoint fsyncs it by path (an fsync through any descriptor of a file flushes all of
its dirty pages).

The default capacity is derived from the process's descriptor limit (``default_capacity``):
a quarter of it, so that client connections and the commit-log segments keep the rest.
"""

from __future__ import annotations

import os
import resource
from collections import OrderedDict

from .files import FileOps

MIN_CAPACITY = 8
MAX_CAPACITY = 4096


def fd_limit() -> int:
    """The process's soft limit on open file descriptors."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_capacity(limit: int | None = None) -> int:
    """Open index files allowed for a descriptor limit: a quarter of it, 8..4096."""
    limit = fd_limit() if limit is None else limit
    return max(MIN_CAPACITY, min(MAX_CAPACITY, limit // 4))


class OpenFiles:
    """Path -> descriptor, least recently used first; at most ``capacity`` open."""

    __slots__ = ("_lru", "capacity", "closes", "files", "opens")

    def __init__(self, files: FileOps, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.files = files
        self.capacity = capacity
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.opens = 0  # files opened (a miss), for tests and status
        self.closes = 0  # files closed to stay under the capacity

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, path: str) -> int:
        """An open descriptor of the existing file ``path`` (read-write).

        Use it at once: a later ``get`` or ``create`` may close it."""
        fd = self._lru.get(path)
        if fd is not None:
            self._lru.move_to_end(path)
            return fd
        fd = self.files.open(path, os.O_RDWR)
        self._add(path, fd)
        return fd

    def create(self, path: str) -> int:
        """Create (or truncate) ``path`` and return its open descriptor."""
        self.close(path)
        fd = self.files.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._add(path, fd)
        return fd

    def _add(self, path: str, fd: int) -> None:
        self.opens += 1
        lru = self._lru
        while len(lru) >= self.capacity:
            _p, old = lru.popitem(last=False)
            self.closes += 1
            self.files.close(old)
        lru[path] = fd

    def close(self, path: str) -> None:
        """Close ``path`` if it is open (before it is unlinked or truncated away)."""
        fd = self._lru.pop(path, None)
        if fd is not None:
            self.files.close(fd)

    def close_under(self, directory: str) -> None:
        """Close every open file below ``directory`` (a queue or topic going away)."""
        prefix = directory.rstrip(os.sep) + os.sep
        for path in [p for p in self._lru if p.startswith(prefix)]:
            self.close(path)

    def close_all(self) -> None:
        for fd in self._lru.values():
            self.files.close(fd)
        self._lru.clear()


def fsync_paths(files: FileOps, paths: list[str]) -> None:
    """Fsync files by path (safe off the event loop: its own descriptors). A file removed
    meanwhile (queue deleted, index cut) needs nothing."""
    for path in paths:
        try:
            fd = files.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            files.fsync(fd)
        finally:
            files.close(fd)
