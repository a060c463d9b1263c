"""The damaged ranges of a store: commit-log positions and queue offsets lost to disk damage.

Recovery and reads find damage (a record whose checksum fails, a segment file that went
missing); the broker skips it and keeps everything else. Pulls skip damaged offsets through
their index entries (damage markers); this registry lists the ranges for the broker status
across restarts. It is persisted as ``damaged.json`` in the data directory (written
atomically); a lost or unreadable file only empties the list.
"""

from __future__ import annotations

import logging

from .files import OS_FILES, FileOps
from .metadata import load_json, save_json

log = logging.getLogger("onceq.storage")


def add_range(ranges: list[list[int]], start: int, end: int) -> bool:
    """Merge ``[start, end)`` into sorted disjoint ``ranges``; True when they changed."""
    if end <= start:
        return False
    out: list[list[int]] = []
    placed = False
    for a, b in ranges:
        if b < start or a > end:
            if a > end and not placed:
                out.append([start, end])
                placed = True
            out.append([a, b])
        else:
            start, end = min(a, start), max(b, end)
    if not placed:
        out.append([start, end])
    out.sort()
    changed = out != ranges
    ranges[:] = out
    return changed


class DamageRegistry:
    def __init__(self, path: str, files: FileOps = OS_FILES) -> None:
        self.path = path
        self.files = files
        self.log_ranges: list[list[int]] = []  # commit-log positions [start, end)
        self.queues: dict[tuple[str, int], list[list[int]]] = {}  # queue offsets [lo, hi)

    def load(self) -> None:
        self.log_ranges = []
        self.queues = {}
        try:
            raw = load_json(self.path, {}, self.files)
            log_ranges = [[int(a), int(b)] for a, b in raw.get("log", [])]
            queues = {}
            for topic, qs in raw.get("queues", {}).items():
                for qid, ranges in qs.items():
                    queues[(str(topic), int(qid))] = [[int(a), int(b)] for a, b in ranges]
        except (ValueError, TypeError, AttributeError) as exc:
            # the index markers still know the damaged offsets
            msg = str(exc) if self.path in str(exc) else f"{self.path}: malformed ({exc})"
            log.error("store: %s; starting with an empty damage list", msg)
            return
        self.log_ranges, self.queues = log_ranges, queues

    def to_json(self) -> dict:
        queues: dict[str, dict[str, list[list[int]]]] = {}
        for (topic, qid), ranges in sorted(self.queues.items()):
            if ranges:
                queues.setdefault(topic, {})[str(qid)] = ranges
        return {"log": self.log_ranges, "queues": queues}

    def save(self) -> None:
        save_json(self.path, self.to_json(), self.files)

    def add_log(self, start: int, end: int) -> bool:
        return add_range(self.log_ranges, start, end)

    def add_offsets(self, topic: str, queue_id: int, lo: int, hi: int) -> bool:
        return add_range(self.queues.setdefault((topic, queue_id), []), lo, hi)
