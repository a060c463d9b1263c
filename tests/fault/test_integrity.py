"""Damage that costs only itself: damaged records, index entries, topics beyond the end,
repeated offsets, a recovered tail made durable, and start-up that reads only the tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onceq.log.record import REC_HEADER_SIZE, build_record, decode_records, encode_part
from onceq.log.segment import FILE_HEADER_SIZE, INDEX_ENTRY_SIZE
from onceq.protocol.codes import PullStatus
from onceq.storage import recovery
from onceq.storage.config import StoreConfig
from onceq.storage.damage import add_range
from onceq.storage.files import OS_FILES, FileOps
from onceq.storage.store import MessageStore
from onceq.storage.verify import verify_store
from tests.clock import FakeClock
from tests.faultfiles import CountingFiles
from tests.helpers import kill_store as crash
from tests.powercut import PowerCutFiles

SEG = 64 * 1024
T0 = 1_700_000_000.0
BODY = 300


def cfg(root: str, **kw) -> StoreConfig:
    kw = {"segment_size": SEG, "index_entries_per_file": 100, "max_body": 8 * 1024, **kw}
    return StoreConfig(root, **kw)


def open_store(root: str, files: FileOps = OS_FILES, **kw) -> MessageStore:
    store = MessageStore(cfg(root, **kw), clock=FakeClock(T0), files=files)
    store.open()
    return store




def body(i: int) -> bytes:
    return f"m{i:05d}".encode().ljust(BODY, b".")


def send(store: MessageStore, topic: str, first: int, n: int, queues: int = 1) -> dict:
    """Send messages first..first+n-1 round-robin over queues; return {uk: (q, offset)}."""
    acked = {}
    for i in range(first, first + n):
        uk = f"UK{i:06d}"
        q = i % queues
        r = store.put(topic, q, [encode_part(body(i), uk, 1)])
        acked[uk] = (q, r.offsets[0])
    return acked


def read_queue(store: MessageStore, topic: str, qid: int) -> tuple[dict, list[int]]:
    """{offset: message} readable, and the offsets pulled as DAMAGED."""
    lo, hi = store.min_max(topic, qid)
    off, got, bad = lo, {}, []
    while off < hi:
        r = store.get(topic, qid, off, 16, 1 << 20)
        if r.status == PullStatus.DAMAGED:
            bad.extend(range(off, r.next_offset))
        else:
            assert r.status == PullStatus.FOUND, r
            for m in decode_records(r.payload, True, off, r.next_offset):
                got[m.queue_offset] = m
        assert r.next_offset > off
        off = r.next_offset
    return got, bad


def segments(root: str) -> list[str]:
    d = os.path.join(root, "commitlog")
    return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.isdigit()]


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x5A]))


def test_a_flipped_byte_in_an_old_segment_costs_one_message(tmp_path):
    """The user's case: 2,000 sends over 10 segments, one byte flipped mid segment 2."""
    for crashed in (False, True):
        root = str(tmp_path / f"c{crashed}")
        store = open_store(root, segment_size=SEG)
        store.create_topic("T", 4)
        acked = send(store, "T", 0, 2000, queues=4)
        assert len(store.log.segments) >= 10
        if crashed:
            crash(store)  # no checkpoint since open: the whole log is the tail
        else:
            store.close()
        seg2 = segments(root)[1]
        flip(seg2, FILE_HEADER_SIZE + (os.path.getsize(seg2) - FILE_HEADER_SIZE) // 2)
        store = open_store(root, segment_size=SEG)
        assert len(segments(root)) == len(store.log.segments) >= 10  # nothing deleted
        readable, damaged = {}, []
        for q in range(4):
            got, bad = read_queue(store, "T", q)
            readable.update({(q, o): m for o, m in got.items()})
            damaged.extend((q, o) for o in bad)
        assert len(damaged) == 1
        assert len(readable) == 1999
        for uk, (q, off) in acked.items():
            if (q, off) not in damaged:
                m = readable[q, off]
                assert m.unique_key == uk and m.body == body(int(uk[2:]))
        q, off = damaged[0]
        assert store.repair.damaged()["queues"] == {"T": {str(q): [[off, off + 1]]}}
        # reported offline too, and still after a restart
        store.close()
        report = verify_store(root)
        assert report.damaged
        assert [(d.topic, d.queue_id, d.first, d.last) for d in report.queues] == [
            ("T", q, off, off)]
        store = open_store(root, segment_size=SEG)
        assert read_queue(store, "T", q)[1] == [off]
        store.close()


def _entry_path(root: str, topic: str, qid: int, offset: int, per_file: int = 100) -> tuple:
    base = offset - offset % per_file
    path = os.path.join(root, "queues", topic, str(qid), f"{base:020d}")
    return path, FILE_HEADER_SIZE + (offset - base) * INDEX_ENTRY_SIZE


def test_swapped_and_zeroed_index_entries_are_repaired_from_the_log(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    acked = send(store, "T", 0, 60)
    store.close()  # the checkpoint covers every entry: they are trusted at start
    p10, at10 = _entry_path(root, "T", 0, 10)
    _p20, at20 = _entry_path(root, "T", 0, 20)
    _p30, at30 = _entry_path(root, "T", 0, 30)
    with open(p10, "r+b") as f:
        f.seek(at10)
        e10 = f.read(INDEX_ENTRY_SIZE)
        f.seek(at20)
        e20 = f.read(INDEX_ENTRY_SIZE)
        f.seek(at10)
        f.write(e20)
        f.seek(at20)
        f.write(e10)
        f.seek(at30)
        f.write(bytes(INDEX_ENTRY_SIZE))
    assert {d.first for d in verify_store(root).queues} == {10, 20, 30}
    store = open_store(root)
    for off in (10, 20, 30):
        r = store.get("T", 0, off, 1, 1 << 20)
        assert r.status == PullStatus.FOUND and r.count == 1 and r.next_offset == off + 1
        (m,) = decode_records(r.payload)
        assert m.queue_offset == off and m.unique_key == f"UK{off:06d}"
    got, bad = read_queue(store, "T", 0)
    assert bad == [] and {m.unique_key: (0, o) for o, m in got.items()} == acked
    assert store.repair.damaged()["queues"] == {}
    store.close()
    assert not verify_store(root).damaged  # the repaired entries reached the disk


def test_an_unrepairable_entry_is_marked_damaged_not_returned_as_found(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    send(store, "T", 0, 40)
    store.close()
    # the record of offset 30 is damaged below the checkpoint: found only by reading it
    store = open_store(root)
    pos, _size, _th, _ts = store.queues["T", 0].entry(30)
    seg = store.log._find(pos)
    store.close()
    flip(seg.path, FILE_HEADER_SIZE + pos - seg.base + REC_HEADER_SIZE + 5)
    store = open_store(root)
    r = store.get("T", 0, 28, 10, 1 << 20)  # stops before the damaged record
    assert r.status == PullStatus.FOUND and r.count == 2 and r.next_offset == 30
    r = store.get("T", 0, 30, 10, 1 << 20)
    assert r.status == PullStatus.DAMAGED and r.next_offset == 31 and r.payload == b""
    r = store.get("T", 0, 31, 10, 1 << 20)
    assert r.status == PullStatus.FOUND and r.count == 9
    assert store.repair.damaged()["queues"] == {"T": {"0": [[30, 31]]}}
    store.close()
    store = open_store(root)  # persisted: the index entry is marked
    assert store.get("T", 0, 30, 10, 1 << 20).status == PullStatus.DAMAGED
    assert store.repair.damaged()["queues"] == {"T": {"0": [[30, 31]]}}
    store.delete_topic("T")  # a topic created again under the name starts clean
    store.create_topic("T", 1)
    send(store, "T", 0, 40)
    assert store.repair.damaged()["queues"] == {}
    store.close()
    assert verify_store(root).queues == []  # the old record's bytes are still listed


def test_an_unreadable_damage_list_does_not_stop_the_store(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    send(store, "T", 0, 5)
    store.close()
    with open(os.path.join(root, "damaged.json"), "w") as f:
        f.write("{not json")
    store = open_store(root)
    assert store.repair.damaged() == {"log": [], "queues": {}}
    assert len(read_queue(store, "T", 0)[0]) == 5
    store.close()


def test_add_range_merges_and_orders():
    ranges: list[list[int]] = []
    assert add_range(ranges, 10, 12)
    assert add_range(ranges, 1, 3)
    assert not add_range(ranges, 10, 11)
    assert add_range(ranges, 12, 15)  # adjacent: merged
    assert add_range(ranges, 2, 11)  # bridges both
    assert ranges == [[1, 15]]
    assert add_range(ranges, 20, 21) and ranges == [[1, 15], [20, 21]]
    assert not add_range(ranges, 5, 5)


def test_topic_created_beyond_the_recovered_end_keeps_its_messages(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("A", 1)
    send(store, "A", 0, 100)
    store.close()
    # a creation position beyond the log end (the log lost its tail after the topic was made)
    with open(os.path.join(root, "topics.json")) as f:
        topics = json.load(f)
    end = os.path.getsize(segments(root)[-1]) - FILE_HEADER_SIZE + (len(segments(root)) - 1) * SEG
    topics["B"] = {"queues": 1, "created_position": end + 5000, "created_ms": 1}
    with open(os.path.join(root, "topics.json"), "w") as f:
        json.dump(topics, f)
    store = open_store(root)
    assert store.topics["B"].created_position == store.log.end
    acked = send(store, "B", 0, 100)
    store.close()
    store = open_store(root)
    got, bad = read_queue(store, "B", 0)
    assert bad == [] and {m.unique_key: (0, o) for o, m in got.items()} == acked
    store.close()


def test_recovery_keeps_the_later_record_of_a_repeated_offset(tmp_path):
    """A write that reached the log but failed (never acknowledged) and a later, acknowledged
    write of the same offset: after a crash the acknowledged one is at the offset."""
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    send(store, "T", 0, 5)
    store.write_checkpoint()
    store.put("T", 0, [encode_part(b"failed", "FAILED", 1)])  # offset 5, then "fails":
    store.queues["T", 0].truncate(5)  # the index append did not happen
    r = store.put("T", 0, [encode_part(b"acked", "ACKED", 1)])
    assert r.offsets == [5]
    crash(store)
    store = open_store(root)
    got, bad = read_queue(store, "T", 0)
    assert bad == [] and sorted(got) == [0, 1, 2, 3, 4, 5]
    assert got[5].unique_key == "ACKED" and got[5].body == b"acked"
    store.close()


def test_sync_recovered_tail_is_fsynced_before_anything_is_answered(tmp_path):
    """Written but not fsynced, process killed: recovery finds the records in the page
    cache; they must reach the disk during open, or a power cut loses them after the
    broker answered a producer's retry "duplicate"."""
    root = str(tmp_path)
    files = PowerCutFiles()
    store = open_store(root, files, flush="sync")
    store.create_topic("T", 1)
    send(store, "T", 0, 10)
    store.write_checkpoint()
    acked = send(store, "T", 10, 5)  # written, the fsync never ran
    crash(store)  # SIGKILL
    store = open_store(root, files, flush="sync")
    # the producer retries: answered as a duplicate of the stored message
    r = store.put("T", 0, [encode_part(body(12), "UK000012", 1)])
    assert r.duplicates == [0] and r.offsets == [acked["UK000012"][1]]
    crash(store)
    files.cut_power()
    store = open_store(root, files, flush="sync")
    got, bad = read_queue(store, "T", 0)
    assert bad == [] and sorted(got) == list(range(15))
    store.close()


def test_power_cut_model_loses_unsynced_writes(tmp_path):
    """The model itself: what was not fsynced is gone after a cut (so the test above can
    fail)."""
    root = str(tmp_path)
    files = PowerCutFiles()
    store = open_store(root, files)
    store.create_topic("T", 1)
    send(store, "T", 0, 10)
    store.write_checkpoint()
    send(store, "T", 10, 5)
    assert files.unsynced_bytes() > 0
    crash(store)
    files.cut_power()
    store = open_store(root, files)
    assert store.min_max("T", 0) == (0, 10)
    store.close()


def test_open_reads_only_the_tail_after_the_checkpoint(tmp_path):
    """With data older than the dedup window (or no window), start-up reads the log after
    the checkpoint, the segment headers and a few index entries: not the log."""
    for window in (0, 120):
        root = str(tmp_path / str(window))
        clock = FakeClock(T0)
        store = MessageStore(cfg(root, dedup_window_s=window), clock=clock)
        store.open()
        store.create_topic("T", 2)
        send(store, "T", 0, 3000, queues=2)
        store.write_checkpoint()
        clock.advance(600)
        tail = sum(len(encode_part(body(i), "UK000000", 1)) + REC_HEADER_SIZE + 1
                   for i in range(20))
        send(store, "T", 3000, 20, queues=2)
        crash(store)
        files = CountingFiles()
        store = MessageStore(cfg(root, dedup_window_s=window), clock=clock, files=files)
        store.open()
        assert store.log.end - store.log.start > 900_000
        assert files.read < tail + 64 * len(store.log.segments) + 8192, (files.read, tail)
        assert store.min_max("T", 0) == (0, 1510) and store.min_max("T", 1) == (0, 1510)
        if window:  # the tail's keys are known, the old ones expired
            assert store.put("T", 0, [encode_part(body(3000), "UK003000", 1)]).duplicates == [0]
            assert store.put("T", 0, [encode_part(body(0), "UK000000", 1)]).duplicates == []
        store.close()


def test_dedup_window_before_the_checkpoint_is_rebuilt_within_its_key_bound(tmp_path):
    root = str(tmp_path)
    clock = FakeClock(T0)

    def make(files: FileOps = OS_FILES) -> MessageStore:
        s = MessageStore(cfg(root, dedup_max_keys=500), clock=clock, files=files)
        s.open()
        return s

    store = make()
    store.create_topic("T", 3)
    for k in range(0, 2000, 10):  # all inside the window, below the checkpoint
        send(store, "T", k, 10, queues=3)
        clock.advance(0.01)
    store.close()
    files = CountingFiles()
    store = make(files)
    # the newest 500 records are read (not the 2,000 of the window)
    assert files.read < 600 * (BODY + 120), files.read
    for i, dup in ((1999, True), (1500, True), (1000, False)):
        uk = f"UK{i:06d}"
        r = store.put("T", i % 3, [encode_part(body(i), uk, 1)])
        assert (r.duplicates == [0]) is dup, i
        if dup:
            assert r.offsets == [i // 3]
    store.close()


def test_dedup_window_rebuild_past_damaged_bytes_before_the_checkpoint(tmp_path):
    """The window's pass over the trusted log falls back to the resyncing scan at a record
    that does not check: the records after it, in that segment and the next ones, are
    still in the window; the damaged one is not."""
    root = str(tmp_path)
    clock = FakeClock(T0)
    store = MessageStore(cfg(root), clock=clock)
    store.open()
    store.create_topic("T", 2)
    acked = send(store, "T", 0, 3000, queues=2)  # several segments
    store.close()
    assert len(segments(root)) >= 2
    first = segments(root)[0]
    flip(first, FILE_HEADER_SIZE + 1000)  # inside the first record's body, or the second's
    clock.advance(30)
    store = MessageStore(cfg(root), clock=clock)
    store.open()
    for i in (5, 100, 1500, 2999):
        q, off = acked[f"UK{i:06d}"]
        r = store.put("T", q, [encode_part(body(i), f"UK{i:06d}", 1)])
        assert r.duplicates == [0] and r.offsets == [off], i
    lost = [i for i in (0, 1, 2) if store.put(
        "T", acked[f"UK{i:06d}"][0], [encode_part(body(i), f"UK{i:06d}", 1)]).duplicates == []]
    assert len(lost) == 1  # the damaged record is not in the window
    store.close()


@pytest.mark.parametrize("chunk", [100, 1000, 4096])
def test_dedup_window_rebuild_in_small_read_chunks(tmp_path, monkeypatch, chunk):
    """The window's pass over the log finds every record whatever the read size: records
    that straddle two reads, and records larger than a read."""
    monkeypatch.setattr(recovery, "READ_CHUNK", chunk)
    root = str(tmp_path)
    clock = FakeClock(T0)
    store = MessageStore(cfg(root), clock=clock)
    store.open()
    store.create_topic("T", 2)
    acked = send(store, "T", 0, 400, queues=2)  # over several segments
    store.close()
    clock.advance(10)
    store = MessageStore(cfg(root), clock=clock)
    store.open()
    assert len(store.dedup) == 400
    for i in (0, 1, 150, 399):
        q, off = acked[f"UK{i:06d}"]
        r = store.put("T", q, [encode_part(body(i), f"UK{i:06d}", 1)])
        assert r.duplicates == [0] and r.offsets == [off], i
    store.close()


def _window_answers(store: MessageStore, acked: dict, ids) -> list[bool]:
    """Whether each message's resend is recognised (its offset checked when it is)."""
    out = []
    for i in ids:
        q, off = acked[f"UK{i:06d}"]
        r = store.put("T", q, [encode_part(body(i), f"UK{i:06d}", 1)])
        out.append(r.duplicates == [0])
        if r.duplicates:
            assert r.offsets == [off], i
    return out


def _journal_files(root: str) -> list[str]:
    d = os.path.join(root, "dedup")
    return sorted(os.path.join(d, n) for n in os.listdir(d)) if os.path.isdir(d) else []


def test_dedup_window_journal_at_clean_close_and_crash(tmp_path):
    """A clean close ends the window's journal at the last checkpoint: the next start reads
    no log for the window. After a crash the journal is read up to the last checkpoint and
    only the log after it; every acknowledged key is recognised either way."""
    root = str(tmp_path)
    clock = FakeClock(T0)
    store = MessageStore(cfg(root, dedup_max_keys=300), clock=clock)
    store.open()
    store.create_topic("T", 2)
    store.create_topic("U", 1)
    acked = send(store, "T", 0, 400, queues=2)
    send(store, "U", 1000, 5)
    store.close()
    before = _journal_files(root)
    assert before
    clock.advance(10)
    store = MessageStore(cfg(root, dedup_max_keys=300), clock=clock)
    store.open()
    assert store.dedup_restored_to == store.log.end
    assert len(store.dedup) == 300  # the newest 300 keys of both topics
    assert _window_answers(store, acked, (399, 200, 99)) == [True, True, False]
    acked.update(send(store, "T", 400, 30, queues=2))
    store.write_checkpoint()  # the journal goes on: the keys added since, in a new chunk
    assert before[-1] in _journal_files(root) and len(_journal_files(root)) <= 2
    at_checkpoint = store.log.end
    acked.update(send(store, "T", 430, 20, queues=2))  # after the last checkpoint
    crash(store)
    store = MessageStore(cfg(root, dedup_max_keys=300), clock=clock)
    store.open()
    assert store.dedup_restored_to == at_checkpoint < store.log.end
    assert len(store.dedup) == 300
    assert _window_answers(store, acked, (449, 430, 429, 200)) == [True] * 4
    store.close()


def test_dedup_journal_rotates_and_stays_bounded(tmp_path):
    """Many checkpoints with a small key cap: a new file once one holds ``max_keys``
    entries, at most two kept, and a crash still finds every key the window holds."""
    root = str(tmp_path)
    clock = FakeClock(T0)
    store = MessageStore(cfg(root, dedup_max_keys=50), clock=clock)
    store.open()
    store.create_topic("T", 1)
    acked = {}
    for i in range(40):
        acked.update(send(store, "T", i * 10, 10))
        store.write_checkpoint()
        assert len(_journal_files(root)) <= 2
    crash(store)
    store = MessageStore(cfg(root, dedup_max_keys=50), clock=clock)
    store.open()
    assert store.dedup_restored_to == store.log.end
    assert len(store.dedup) == 50
    assert _window_answers(store, acked, (399, 350, 349)) == [True, True, False]
    store.close()


@pytest.mark.parametrize("change", ["damaged", "window", "max_keys", "ahead", "torn"])
def test_dedup_journal_not_used(tmp_path, change):
    """A damaged or torn chunk, other window settings, or a chunk past the checkpoint: the
    window is filled from the log from where the journal stops being trusted."""
    root = str(tmp_path)
    clock = FakeClock(T0)
    store = MessageStore(cfg(root), clock=clock)
    store.open()
    store.create_topic("T", 1)
    acked = send(store, "T", 0, 30)
    store.write_checkpoint()
    first_end = store.log.end
    with open(os.path.join(root, "checkpoint"), "rb") as f:
        old_checkpoint = f.read()
    acked.update(send(store, "T", 30, 20))
    store.write_checkpoint()
    crash(store)
    (path,) = _journal_files(root)
    kw = {}
    if change == "damaged":  # the second chunk's last byte
        flip(path, os.path.getsize(path) - 1)
    elif change == "torn":
        os.truncate(path, os.path.getsize(path) - 3)
    elif change == "window":
        kw = {"dedup_window_s": 600}
    elif change == "max_keys":
        kw = {"dedup_max_keys": 40}
    else:  # the checkpoint the second chunk ended at was lost: only the first counts
        with open(os.path.join(root, "checkpoint"), "wb") as f:
            f.write(old_checkpoint)
    clock.advance(10)
    store = MessageStore(cfg(root, **kw), clock=clock)
    store.open()
    want = None if change in ("window", "max_keys") else first_end
    assert store.dedup_restored_to == want
    n = 40 if change == "max_keys" else 50
    assert len(store.dedup) == n
    assert all(_window_answers(store, acked, range(50 - n, 50)))
    # the journal begins anew (a full chunk): the next crash reads only the log after it
    acked.update(send(store, "T", 50, 5))
    store.write_checkpoint()
    end = store.log.end
    crash(store)
    store = MessageStore(cfg(root, **kw), clock=clock)
    store.open()
    assert store.dedup_restored_to == end
    assert all(_window_answers(store, acked, range(55 - n, 55)))
    store.close()


def test_retry_of_a_damaged_first_copy_is_stored_again(tmp_path):
    """The window never answers "duplicate" for a copy that can no longer be read."""
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    acked = send(store, "T", 0, 3)
    pos = store.queues["T", 0].entry(1)[0]
    seg = store.log._find(pos)
    store.log.sync()
    flip(seg.path, FILE_HEADER_SIZE + pos - seg.base + 60)
    assert _window_answers(store, acked, (0, 1, 2)) == [True, False, True]
    # the new copy is the one the window knows now
    r = store.put("T", 0, [encode_part(body(1), "UK000001", 1)])
    assert r.duplicates == [0] and r.offsets == [3]
    store.close()


def test_verify_command_exit_codes_and_json(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    send(store, "T", 0, 300)
    store.close()
    cmd = [sys.executable, "-m", "onceq.cli.main", "broker", "verify", "--data-dir", root]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no damage found" in r.stdout
    seg = segments(root)[0]
    flip(seg, FILE_HEADER_SIZE + 1000)
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["damaged"] and report["records"] == 299
    assert len(report["log"]) == 1 and report["log"][0]["start"] <= 1000 < report["log"][0]["end"]
    assert [(q["topic"], q["queue"], q["first"] == q["last"]) for q in report["queues"]] == [
        ("T", 0, True)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "damaged" in r.stdout


def test_topic_created_after_a_record_that_is_then_cut_as_a_torn_tail(tmp_path):
    """The creation position of a new topic is the log end; damage to the last record
    before it makes recovery cut the log below that position. The topic's next messages
    must still count as its own after a clean restart."""
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("A", 1)
    send(store, "A", 0, 100)
    store.write_checkpoint()
    send(store, "A", 100, 1)  # the last record before the new topic, after the checkpoint
    store.create_topic("B", 1)
    created = store.topics["B"].created_position
    crash(store)
    flip(segments(root)[-1], os.path.getsize(segments(root)[-1]) - 3)  # inside that record
    store = open_store(root)
    assert store.log.end < created
    assert store.topics["B"].created_position == store.log.end
    acked = send(store, "B", 0, 100)
    store.close()
    store = open_store(root)
    got, bad = read_queue(store, "B", 0)
    assert bad == [] and {m.unique_key: (0, o) for o, m in got.items()} == acked
    assert store.min_max("A", 0) == (0, 100)
    store.close()


def test_a_lost_segment_file_is_skipped_in_one_pull_and_later_ones_kept(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    acked = send(store, "T", 0, 800)
    store.close()
    segs = segments(root)
    assert len(segs) >= 4
    lost_base, next_base = int(os.path.basename(segs[1])), int(os.path.basename(segs[2]))
    os.unlink(segs[1])
    store = open_store(root)
    assert len(store.log.segments) == len(segs) - 1
    in_lost = [o for o in range(800)
               if lost_base <= store.queues["T", 0].entry(o)[0] < next_base]
    first = in_lost[0]
    r = store.get("T", 0, first, 32, 1 << 20)
    assert r.status == PullStatus.DAMAGED and r.next_offset == in_lost[-1] + 1
    got, bad = read_queue(store, "T", 0)
    assert bad == in_lost
    assert {m.unique_key: (0, o) for o, m in got.items()} == {
        uk: v for uk, v in acked.items() if v[1] not in in_lost}
    assert store.repair.damaged()["queues"] == {"T": {"0": [[first, in_lost[-1] + 1]]}}
    assert store.repair.damaged()["log"] == [[lost_base, next_base]]
    store.close()


def test_a_later_record_replaces_only_its_own_trusted_entry(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    send(store, "T", 0, 5)
    store.write_checkpoint()
    pos = store.log.end  # a later record claiming offset 3, in the tail, not indexed
    store.log.write([build_record(b"T", 0, 3, pos, 2, encode_part(b"later", "LATER", 1))])
    crash(store)
    store = open_store(root)
    got, bad = read_queue(store, "T", 0)
    assert bad == [] and sorted(got) == [0, 1, 2, 3, 4]
    assert got[3].unique_key == "LATER" and got[4].unique_key == "UK000004"
    store.close()
