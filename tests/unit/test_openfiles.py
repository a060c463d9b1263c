"""OpenFiles: the bounded cache of open index files."""

from __future__ import annotations

import os

import pytest

from onceq.storage.files import FileOps
from onceq.storage.openfiles import OpenFiles, default_capacity, fsync_paths


class CountingFiles(FileOps):
    def __init__(self) -> None:
        self.open_fds: set[int] = set()
        self.fsynced: list[int] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.open_fds.discard(fd)
        super().close(fd)

    def fsync(self, fd: int) -> None:
        self.fsynced.append(fd)
        super().fsync(fd)


def test_least_recently_used_file_is_closed_above_capacity(tmp_path):
    files = CountingFiles()
    cache = OpenFiles(files, 3)
    paths = [str(tmp_path / f"f{i}") for i in range(5)]
    for i, p in enumerate(paths[:3]):
        files.write_all(cache.create(p), f"file {i}".encode(), 0)
    cache.get(paths[0])  # f0 is now the most recently used: f1 goes first
    files.write_all(cache.create(paths[3]), b"file 3", 0)
    assert len(cache) == 3 and len(files.open_fds) == 3
    assert cache.closes == 1
    # f1 was closed, not lost: reopened on demand with its bytes
    assert files.pread(cache.get(paths[1]), 6, 0) == b"file 1"
    assert files.pread(cache.get(paths[0]), 6, 0) == b"file 0"
    assert len(files.open_fds) == 3
    assert cache.opens == 5


def test_close_under_and_close_all(tmp_path):
    files = CountingFiles()
    cache = OpenFiles(files, 10)
    (tmp_path / "a").mkdir()
    (tmp_path / "ab").mkdir()
    cache.create(str(tmp_path / "a" / "x"))
    cache.create(str(tmp_path / "ab" / "y"))
    cache.close_under(str(tmp_path / "a"))
    assert len(cache) == 1  # the sibling directory with the same prefix is kept
    cache.close_all()
    assert not files.open_fds and len(cache) == 0


def test_a_closed_file_is_fsynced_by_path(tmp_path):
    files = CountingFiles()
    cache = OpenFiles(files, 1)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    files.write_all(cache.create(a), b"unsynced", 0)
    cache.create(b)  # closes a before any fsync
    fsync_paths(files, [a, str(tmp_path / "gone")])  # a missing file needs nothing
    assert len(files.fsynced) == 1
    assert files.open_fds == {cache.get(b)}


def test_capacity_from_the_descriptor_limit():
    assert default_capacity(1024) == 256
    assert default_capacity(20) == 8
    assert default_capacity(1 << 20) == 4096
    assert default_capacity() >= 8
    with pytest.raises(ValueError):
        OpenFiles(FileOps(), 0)


def test_get_of_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        OpenFiles(FileOps(), 2).get(os.path.join(tmp_path, "nope"))
