"""The data directory a fixed scenario leaves is the same, byte for byte, release to release.

The scenario runs against ``MessageStore`` directly with a fake clock: topics created, sends
(duplicates caught by the dedup window among them, record batches among them), offset
commits, a checkpoint, a close and a reopen, a topic deleted and created again, a retention
run, a close. The SHA-256 over every file's relative path and bytes must match the constant
recorded when the on-disk formats were last changed on purpose. Nothing in the scenario
depends on the wall clock, the process or chance: the dedup window's digest secret (drawn
at random per window) is drawn from a fixed source here.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from onceq.log.batch import encode_batch
from onceq.log.record import encode_part
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
from tests.clock import FakeClock

GOLDEN_SHA256 = "bd61668a5d8bcfefdfb8a1019d3d1f98c1b0fff333c8719aa4408799a50f4cf2"

T0 = 1_700_000_000.0


def _part(i: int, uk: str) -> bytes:
    body = (f"golden-{i}:".encode() + bytes(range(256)))[: 40 + i % 97]
    return encode_part(body, uk, 1_000 + i, tags=f"tag{i % 3}", keys=f"order-{i}",
                       properties={"i": str(i)})


def _hex_key(i: int) -> str:
    """A producer-shaped unique key (kept exact in the window)."""
    return f"{i:040X}"


def _open(path: Path, clock: FakeClock, **kw: object) -> MessageStore:
    cfg = StoreConfig(str(path), segment_size=64 * 1024, index_entries_per_file=7,
                      max_body=8 * 1024, disk_max_used_ratio=1.0, retention_hours=0,
                      dedup_window_s=120.0, **kw)  # type: ignore[arg-type]
    store = MessageStore(cfg, clock=clock)
    store.open()
    return store


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(len(rel).to_bytes(4, "little") + rel)
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def run_scenario(path: Path) -> None:
    clock = FakeClock(T0)
    store = _open(path, clock)
    store.create_topic("orders", 4)
    store.create_topic("events", 2)
    i = 0
    for batch in range(40):
        q = batch % 4
        parts = []
        for _ in range(1 + batch % 5):
            # every other key producer-shaped, the others digested with the window's secret
            uk = _hex_key(i) if i % 2 else f"key-{i}"
            parts.append(_part(i, uk))
            i += 1
        if batch % 7 == 3:
            parts.append(parts[0])  # a duplicate inside the batch
        res = store.put("orders", q, parts)
        assert len(res.offsets) == len(parts)
        if batch % 6 == 5:
            again = store.put("orders", (q + 1) % 4, parts[:2])  # a producer's retry
            assert again.duplicates == list(range(min(2, len(parts))))
        store.put("events", batch % 2, [_part(1000 + batch, f"ev-{batch}")], dedup=False)
        clock.advance(0.25)
    # record batches, stored as sent: one alone, one with a retried key (split)
    batch = [_part(5000 + k, _hex_key(5000 + k)) for k in range(6)]
    assert store.put_batch("orders", 3, encode_batch(batch)).offsets[0] > 0
    assert store.put_batch("orders", 2, encode_batch([*batch[4:], _part(5006, "b-6")])
                           ).duplicates == [0, 1]
    store.commit_offset("g1", "orders", 0, 3)
    store.commit_offset("g1", "orders", 1, 5)
    store.commit_offset("g2", "events", 0, 7)
    store.write_checkpoint()
    # after the checkpoint: the reopen scans this tail
    for k in range(30):
        store.put("orders", k % 4, [_part(2000 + k, _hex_key(2000 + k))])
        clock.advance(0.5)
    store.commit_offset("g1", "orders", 0, 9)
    store.close()

    clock.advance(10)
    store = _open(path, clock, retention_bytes=80 * 1024)
    dup = store.put("orders", 2, [_part(2001, _hex_key(2001)), _part(3001, _hex_key(3001))])
    assert dup.duplicates == [0]
    store.delete_topic("events")
    store.create_topic("events", 3)
    for k in range(400):  # enough to roll segments for the retention below
        store.put("events", k % 3, [_part(4000 + k, f"big-{k}")])
        clock.advance(0.01)
    store.commit_offset("g2", "events", 1, 2)
    store.write_checkpoint()
    store.run_retention()
    # a record batch in the data kept, with tags and properties
    late = [_part(6000 + k, _hex_key(6000 + k)) for k in range(5)]
    assert store.put_batch("events", 1, encode_batch(late)).offsets
    store.close()


def test_store_data_directory_is_byte_identical(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    counter = iter(range(1, 1 << 30))
    monkeypatch.setattr(os, "urandom",
                        lambda n: hashlib.sha256(str(next(counter)).encode()).digest()[:n])
    run_scenario(tmp_path / "data")
    assert tree_digest(tmp_path / "data") == GOLDEN_SHA256
