"""The writers' sequence table (pure) and its rebuild from a store's log."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.client.sequenced import encode_sequenced
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.log.sequence import (
    SequenceError,
    SequenceTable,
    marker,
    parse_marker,
)
from onceq.storage.config import StoreConfig
from onceq.storage.sequences import SequenceStore
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.helpers import kill_store

K = ("w", "t", 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(1, 8)),
                max_size=40))
def test_any_replay_order_stores_each_message_once_and_without_gaps(sends):
    """Batches (epoch, seq, count) in any order: what the table accepts, per epoch, is a
    gapless run from 0 with no message twice, and epochs only move forward."""
    table = SequenceTable()
    stored: list[tuple[int, int]] = []
    for epoch, seq, count in sends:
        try:
            dup = table.check(K, epoch, seq, count)
        except SequenceError as exc:
            assert exc.gap
            continue
        new = [(epoch, s) for s in range(seq + dup, seq + count)]
        stored += new
        if new:
            table.record(K, epoch, seq + count - 1, 0, 0)
    assert len(stored) == len(set(stored))
    epochs = [e for e, _ in stored]
    assert epochs == sorted(epochs)
    for e in set(epochs):
        assert sorted(s for x, s in stored if x == e) == list(range(epochs.count(e)))


@given(st.text(min_size=1, max_size=200).filter(str.isprintable), st.integers(0, 2 ** 40),
       st.integers(0, 2 ** 40))
def test_marker_round_trip(writer, epoch, seq):
    assert parse_marker(marker(writer, epoch, seq)) == (writer, epoch, seq)


@pytest.mark.parametrize("bad", ["", "1:2", "a:1:w", "1:-1:w", "1:2:", None, "1:2:\n"])
def test_bad_markers(bad):
    with pytest.raises(SequenceError):
        parse_marker(bad)


def test_snapshot_round_trip_and_expiry():
    t = SequenceTable()
    t.record(("w/0", "t", 1), 3, 9, 1000, 77)
    t.record(("w/1", "t", 0), 0, 0, 5000, 80)
    back, pos = SequenceTable.decode_snapshot(json.loads(t.encode_snapshot(123)))
    assert pos == 123 and back.writers == t.writers
    assert back.expire(now_ms=4000, idle_ms=2000) == 1 and list(back.writers) == [
        ("w/1", "t", 0)]
    for raw in ({}, {"format": 1, "position": -1, "writers": []},
                {"format": 1, "position": 0, "writers": [["w", "t", "x", 0, 0, 0, 0]]}):
        with pytest.raises(ValueError):
            SequenceTable.decode_snapshot(raw)


def _parts(writer: str, epoch: int, seq: int, n: int) -> list[bytes]:
    payload = encode_sequenced(writer, epoch, seq, [(b"x" * 300, "", "", "", None)] * n, 1)
    out, p = [], 0
    while p < len(payload):
        size = int.from_bytes(payload[p:p + 4], "little")
        out.append(payload[p + 4:p + 4 + size])
        p += 4 + size
    return out


def test_rebuilt_from_snapshot_and_log_after_a_crash(tmp_path):
    cfg = StoreConfig(str(tmp_path), segment_size=64 * 1024, max_body=8 * 1024)
    store = MessageStore(cfg, clock=FakeClock(1_700_000_000.0))
    store.open()
    seqs = SequenceStore(store, 3600)
    seqs.open()
    store.create_topic("t", 2)
    for i in range(20):  # several segments
        store.put("t", 0, _parts("a", 0, i * 10, 10), dedup=False)
        seqs.table.record(("a", "t", 0), 0, i * 10 + 9, 0, store.log.end - 1)
    seqs.save()
    for i in range(20, 30):  # after the snapshot: found in the log
        store.put("t", 0, _parts("a", 0, i * 10, 10), dedup=False)
    store.put("t", 1, _parts("b", 4, 0, 3), dedup=False)
    store.put("t", 1, [_parts("c", 0, 0, 2)[0]])  # the first part: no flag
    kill_store(store)

    store = MessageStore(cfg, clock=FakeClock(1_700_000_100.0))
    store.open()
    again = SequenceStore(store, 3600)
    again.open()
    table = again.table.writers
    assert (table[("a", "t", 0)].epoch, table[("a", "t", 0)].seq) == (0, 299)
    assert (table[("b", "t", 1)].epoch, table[("b", "t", 1)].seq) == (4, 2)
    assert ("c", "t", 1) not in table  # a message without the flag carries no sequence
    assert again.replayed == 11


def _open(cfg: StoreConfig) -> tuple[MessageStore, SequenceStore]:
    store = MessageStore(cfg, clock=FakeClock(1_700_000_000.0))
    store.open()
    seqs = SequenceStore(store, 3600)
    seqs.open()
    return store, seqs


def test_a_snapshot_beyond_the_recovered_log_is_not_trusted(tmp_path):
    """A power cut lost the log tail the snapshot covers: the table comes from the log, so
    the lost messages are not taken for stored ones."""
    cfg = StoreConfig(str(tmp_path), segment_size=64 * 1024, max_body=8 * 1024)
    store, seqs = _open(cfg)
    store.create_topic("t", 1)
    store.put("t", 0, _parts("a", 0, 0, 10), dedup=False)
    seqs.table.record(("a", "t", 0), 0, 9, 0, store.log.end - 1)
    seqs.table.record(("a", "t", 0), 0, 19, 0, store.log.end + 500)  # its records: lost
    snap = json.loads(seqs.table.encode_snapshot(store.log.end + 1000))
    with open(seqs.path, "w") as f:
        json.dump(snap, f)
    kill_store(store)
    store, seqs = _open(cfg)
    state = seqs.table.writers[("a", "t", 0)]
    assert (state.epoch, state.seq) == (0, 9)


def test_damaged_bytes_in_the_log_are_skipped(tmp_path, caplog):
    cfg = StoreConfig(str(tmp_path), segment_size=64 * 1024, max_body=8 * 1024)
    store, seqs = _open(cfg)
    store.create_topic("t", 1)
    store.put("t", 0, _parts("a", 0, 0, 5), dedup=False)
    damaged_at = store.log.end
    store.put("t", 0, _parts("a", 0, 5, 5), dedup=False)
    store.put("t", 0, _parts("a", 0, 10, 5), dedup=False)
    kill_store(store)
    seg = os.path.join(str(tmp_path), "commitlog",
                       sorted(os.listdir(os.path.join(str(tmp_path), "commitlog")))[0])
    with open(seg, "r+b") as f:  # the magic of the first record of the second batch
        f.seek(FILE_HEADER_SIZE + damaged_at + 8)
        f.write(b"\x00")
    store, seqs = _open(cfg)
    state = seqs.table.writers[("a", "t", 0)]
    assert (state.epoch, state.seq) == (0, 14)
    assert "hold no record; skipped" in caplog.text  # through the resyncing scan
