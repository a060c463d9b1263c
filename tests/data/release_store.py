"""The data directory of ``store_v1.tar.gz``: written by the release before batch records
with this module (it imports only what both releases have), then packed with
``python -m tests.data.release_store OUT.tar.gz`` run with that release on the path."""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
from tests.clock import FakeClock

T0 = 1_700_000_000.0
PAD = 2048


def open_store(path: Path, clock: FakeClock, **kw: object) -> MessageStore:
    cfg: dict = dict(segment_size=64 * 1024, index_entries_per_file=7, max_body=8 * 1024,
                     disk_max_used_ratio=1.0)
    cfg.update(kw)
    store = MessageStore(StoreConfig(str(path), **cfg), clock=clock)
    store.open()
    return store


def body(i: int, pad: int = 0) -> bytes:
    return b"body-%d" % i + b"." * pad


def msg(i: int, tags: str = "", pad: int = 0) -> bytes:
    return encode_part(body(i, pad), f"K{i:08d}", 1_000 + i, tags=tags)


def write_release_store(path: Path) -> None:
    """Topic "orders" with 2 queues: message i (0..59, bodies padded to 2 KiB: two
    segments) in queue i % 2, tag "t" unless i % 4 is 0; group "g" committed 7 in queue 0;
    a checkpoint; then message 60 in queue 0."""
    clock = FakeClock(T0)
    store = open_store(path, clock)
    store.create_topic("orders", 2)
    for i in range(60):
        store.put("orders", i % 2, [msg(i, "t" if i % 4 else "", PAD)])
        clock.advance(0.05)
    store.commit_offset("g", "orders", 0, 7)
    store.write_checkpoint()
    store.put("orders", 0, [msg(60, "", PAD)])
    store.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        write_release_store(Path(d) / "store")
        with tarfile.open(sys.argv[1], "w:gz") as tar:
            tar.add(Path(d) / "store", arcname="store")
