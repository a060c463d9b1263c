"""The leader-epoch file of a replica (Kafka's ``leader-epoch-checkpoint``): for each
leader epoch of its broker group, the commit-log position where that epoch's records
start.

A leader appends ``(epoch, log end)`` when it is elected, before it takes a write; a
follower copies the leader's entries as it fetches the records they cover. A replica that
comes back after a failover asks the leader where its own last epoch ends in the leader's
log (``epoch_end``) and cuts its log there: what it holds past that point was never
acknowledged under that epoch.

The file is text, one entry a line, after a version line and a count::

    0
    2
    1 0
    3 4096

The encoding and the rules are pure functions; ``LeaderEpochs`` keeps the entries of one
data directory, written atomically (``metadata.write_atomic``).
"""

from __future__ import annotations

import itertools
import os

from .files import OS_FILES, FileOps
from .metadata import write_atomic

VERSION = 0
FILE_NAME = "leader-epoch-checkpoint"

Entry = tuple[int, int]  # (epoch, start position)


class EpochFileError(ValueError):
    """A leader-epoch file that is not one onceq wrote."""


def encode_epochs(entries: list[Entry]) -> bytes:
    lines = [str(VERSION), str(len(entries))] + [f"{e} {p}" for e, p in entries]
    return ("\n".join(lines) + "\n").encode()


def decode_epochs(raw: bytes) -> list[Entry]:
    """The entries of a file, checked: epochs rising, start positions never falling."""
    try:
        lines = raw.decode("ascii").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines or int(lines[0]) != VERSION:
            raise EpochFileError(f"version {lines[0] if lines else '(none)'!r} is not "
                                 f"{VERSION}")
        count = int(lines[1])
        rows = lines[2:]
        if count != len(rows):
            raise EpochFileError(f"{len(rows)} entries where the count says {count}")
        entries = [(int(a), int(b)) for a, b in (r.split(" ") for r in rows)]
    except (UnicodeDecodeError, ValueError, IndexError) as exc:
        if isinstance(exc, EpochFileError):
            raise
        raise EpochFileError(f"malformed leader-epoch file: {exc}") from None
    check_entries(entries)
    return entries


def check_entries(entries: list[Entry]) -> None:
    for (e0, p0), (e1, p1) in itertools.pairwise(entries):
        if e1 <= e0 or p1 < p0:
            raise EpochFileError(f"entry ({e1}, {p1}) after ({e0}, {p0}): epochs must rise "
                                 "and positions must not fall")
    if any(e < 0 or p < 0 for e, p in entries):
        raise EpochFileError("epochs and positions are >= 0")


def epoch_end(entries: list[Entry], epoch: int, log_end: int) -> Entry:
    """Where leader epoch ``epoch`` ends in a log of these entries that ends at
    ``log_end``: ``(e, end)`` with ``e`` the largest epoch at or below ``epoch`` and
    ``end`` the start of the next epoch (``log_end`` for the latest); ``(-1, -1)`` when
    every epoch is above ``epoch``."""
    found = -1
    for i, (e, _start) in enumerate(entries):
        if e > epoch:
            break
        found = i
    if found < 0:
        return (-1, -1)
    if found + 1 < len(entries):
        return (entries[found][0], entries[found + 1][1])
    return (entries[found][0], log_end)


def assign(entries: list[Entry], epoch: int, start: int) -> list[Entry]:
    """``entries`` with epoch ``epoch`` starting at ``start`` (unchanged when the last
    entry is that epoch already, or a later one). Entries of earlier epochs that start at
    or after ``start`` are dropped: they hold no record."""
    if entries and entries[-1][0] >= epoch:
        return entries
    kept = [(e, p) for e, p in entries if p < start]
    return [*kept, (epoch, start)]


def truncate(entries: list[Entry], position: int) -> list[Entry]:
    """``entries`` of a log cut at ``position``: epochs that start after it go (an epoch
    that starts exactly there stays: its next records will be fetched again)."""
    return [(e, p) for e, p in entries if p <= position]


def merge_from_leader(own: list[Entry], leader: list[Entry], end: int) -> list[Entry]:
    """A follower's entries once its log ends at ``end``: the leader's entries that start
    below ``end`` (the follower holds records of theirs), kept from where they differ."""
    out = list(own)
    for e, p in leader:
        if p >= end:
            break
        out = assign(out, e, p)
    return out


class LeaderEpochs:
    """The entries of the leader-epoch file in ``data_dir``."""

    def __init__(self, data_dir: str, files: FileOps = OS_FILES) -> None:
        self.path = os.path.join(data_dir, FILE_NAME)
        self.files = files
        self.entries: list[Entry] = []

    def load(self) -> list[Entry]:
        try:
            raw = self.files.read_file(self.path)
        except FileNotFoundError:
            raw = b""
        self.entries = decode_epochs(raw) if raw else []
        return self.entries

    @property
    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else 0

    def set(self, entries: list[Entry]) -> None:
        """Replace the entries (written first, then kept in memory)."""
        if entries == self.entries:
            return
        check_entries(entries)
        write_atomic(self.path, encode_epochs(entries), self.files)
        self.entries = list(entries)
