"""Store configuration with the defaults users of RocketMQ/NATS expect."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreConfig:
    data_dir: str
    segment_size: int = 1024 * 1024 * 1024  # commit-log segment, bytes
    index_entries_per_file: int = 300_000  # consume-queue entries per index file
    flush: str = "async"  # "async" or "sync"
    flush_interval_ms: int = 500  # async flush: background fsync period
    checkpoint_interval_ms: int = 1000  # how often indexes are fsynced and checkpointed
    max_body: int = 4 * 1024 * 1024  # largest message body accepted
    retention_hours: float = 72.0  # delete segments older than this (0: keep forever)
    retention_bytes: int = 0  # delete oldest segments above this total (0: unlimited)
    dedup_window_s: float = 120.0  # producer-retry dedup window on the unique key
    dedup_max_keys: int = 2_000_000  # memory bound of the dedup window
    # writes are refused with DISK_FULL while the data dir's file system is used above this
    # ratio (1.0: never; RocketMQ refuses writes at 0.90, its diskSpaceWarningLevelRatio)
    disk_max_used_ratio: float = 0.90
    # index files kept open at once (least recently used closed first); 0: a quarter of
    # the process's descriptor limit (see openfiles.py)
    max_open_index_files: int = 0

    def validate(self) -> None:
        if self.flush not in ("async", "sync"):
            raise ValueError(f"flush policy must be 'async' or 'sync', not {self.flush!r}")
        if self.segment_size < 64 * 1024:
            raise ValueError("segment_size must be at least 64 KiB")
        if self.max_body + 4096 > self.segment_size:
            raise ValueError("segment_size must exceed max_body by at least 4 KiB")
        if self.index_entries_per_file < 1:
            raise ValueError("index_entries_per_file must be >= 1")
        if self.flush_interval_ms <= 0 or self.checkpoint_interval_ms <= 0:
            raise ValueError("flush intervals must be positive")
        if self.retention_hours < 0 or self.retention_bytes < 0:
            raise ValueError("retention limits must be >= 0")
        if self.dedup_window_s < 0 or self.dedup_max_keys < 0:
            raise ValueError("dedup window settings must be >= 0")
        if not 0.0 < self.disk_max_used_ratio <= 1.0:
            raise ValueError("disk_max_used_ratio must be in (0, 1]")
        if self.max_open_index_files < 0:
            raise ValueError("max_open_index_files must be >= 0 (0: from the fd limit)")
