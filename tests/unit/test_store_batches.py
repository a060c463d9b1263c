"""Batch records in the store: a producer's batch stored as one record, read back by offset
range and tag, dedup, restart and index rebuild, index repair, segment rolls, and a data
directory written before batch records existed (``tests/data/store_v1.tar.gz``, made by
``tests/data/release_store.py`` with the release before them) opened, read and written."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

from onceq.log.batch import encode_batch
from onceq.log.record import decode_records, encode_part, tag_hash
from onceq.log.segment import FILE_HEADER, INDEX_ENTRY, LOG_MAGIC
from onceq.log.sequence import SEQUENCED
from onceq.protocol.codes import PullStatus
from onceq.storage.config import StoreConfig
from onceq.storage.sequences import scan_sequenced
from onceq.storage.store import MessageStore
from onceq.storage.verify import verify_store
from tests.clock import FakeClock
from tests.data.release_store import PAD, body, msg

T0 = 1_700_000_000.0
FIXTURE = Path(__file__).parent.parent / "data" / "store_v1.tar.gz"


def open_store(path: Path, clock: FakeClock | None = None, **kw: object) -> MessageStore:
    cfg: dict = dict(segment_size=64 * 1024, index_entries_per_file=7, max_body=32 * 1024,
                     disk_max_used_ratio=1.0)
    cfg.update(kw)
    store = MessageStore(StoreConfig(str(path), **cfg), clock=clock or FakeClock(T0))
    store.open()
    return store


def read(store: MessageStore, topic: str, qid: int, offset: int = 0, max_msgs: int = 32,
         max_bytes: int = 1 << 30, tags: frozenset[int] | None = None) -> list[tuple]:
    """(offset, body) of every message from ``offset`` on, as a consumer gets them."""
    out = []
    while True:
        r = store.get(topic, qid, offset, max_msgs, max_bytes, tags)
        if r.status != PullStatus.FOUND:
            assert r.status == PullStatus.NO_NEW_MESSAGE, r.status
            return out
        got = [(m.queue_offset, m.body) for m in
               decode_records(r.payload, True, offset, r.next_offset, tags)]
        assert len(got) == r.count
        out += got
        offset = r.next_offset


def test_a_batch_is_one_record_read_back_by_any_offset_range(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    res = store.put_batch("T", 0, encode_batch([msg(i) for i in range(10)]))
    assert res.offsets == list(range(10)) and not res.duplicates
    res = store.put("T", 0, [msg(10)])  # a single record after it
    assert res.offsets == [10]
    res = store.put_batch("T", 0, encode_batch([msg(i) for i in range(11, 15)]))
    assert res.offsets == [11, 12, 13, 14]
    want = [(i, b"body-%d" % i) for i in range(15)]
    for start in range(15):
        for max_msgs in (1, 3, 32):
            assert read(store, "T", 0, start, max_msgs) == want[start:]
    # a batch record is read once for all its messages: the bytes of 3 records
    r = store.get("T", 0, 0, 32, 1 << 30)
    assert r.count == 15 and r.next_offset == 15
    assert len(r.payload) == sum(size for _p, size in {
        (p, s) for p, s, _t, _ts in (store.topics.queue("T", 0).entry(o) for o in range(15))})
    # max_bytes counts each record once, and always returns at least one
    assert read(store, "T", 0, 0, 32, 1) == want
    store.close()


def test_tag_filters_pick_messages_inside_batches(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    tags = ["a", "b", "", "a", "c", "b"] * 3
    store.put_batch("T", 0, encode_batch([msg(i, t) for i, t in enumerate(tags)]))
    for wanted in ({"a"}, {"b", "c"}, {"z"}):
        hashes = frozenset(tag_hash(t) for t in wanted)
        assert [o for o, _b in read(store, "T", 0, 0, 4, tags=hashes)] == [
            i for i, t in enumerate(tags) if t in wanted]
    store.close()


def test_a_retried_batch_is_recognised_whole_or_in_part(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 2)
    first = store.put_batch("T", 0, encode_batch([msg(i) for i in range(5)]))
    again = store.put_batch("T", 1, encode_batch([msg(i) for i in range(5)]))
    assert again.duplicates == [0, 1, 2, 3, 4]
    assert again.duplicate_queues == [0] * 5 and again.offsets == first.offsets
    mixed = store.put_batch("T", 1, encode_batch([msg(3), msg(9), msg(9), msg(10)]))
    assert mixed.duplicates == [0, 2]
    assert mixed.offsets == [3, 0, 0, 1] and mixed.duplicate_queues == [0, 1]
    assert read(store, "T", 1) == [(0, b"body-9"), (1, b"body-10")]
    store.close()


def test_batches_survive_a_restart_and_a_rebuild_of_every_index(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 2)
    sent: dict[int, list] = {0: [], 1: []}
    tagged: set[tuple[int, int]] = set()  # (queue, offset) sent with tag "x"
    n = 0
    for b in range(40):  # rolls segments: a record never spans two
        q = b % 2
        size = 1 + b % 9
        res = store.put_batch("T", q, encode_batch([msg(n + i, "x" if i % 3 else "", 1000)
                                                    for i in range(size)]))
        sent[q] += [(o, body(n + i, 1000)) for i, o in enumerate(res.offsets)]
        tagged |= {(q, o) for i, o in enumerate(res.offsets) if i % 3}
        n += size
        clock.advance(0.1)
    assert len(store.log.segments) > 3
    store.close()
    store = open_store(tmp_path, clock)
    assert read(store, "T", 0) == sent[0] and read(store, "T", 1) == sent[1]
    store.close()
    shutil.rmtree(tmp_path / "queues")
    os.remove(tmp_path / "checkpoint")
    store = open_store(tmp_path, clock)
    assert read(store, "T", 0) == sent[0] and read(store, "T", 1) == sent[1]
    hashes = frozenset([tag_hash("x")])
    for q in (0, 1):
        assert [o for o, _b in read(store, "T", q, tags=hashes)] == [
            o for o, _b in sent[q] if (q, o) in tagged]
    # the dedup window came back from the log: a retry of a stored batch is recognised
    retry = store.put_batch("T", 1, encode_batch([msg(0, "", 1000), msg(1, "x", 1000)]))
    assert retry.duplicates == [0, 1]
    store.close()
    report = verify_store(str(tmp_path))
    assert not report.damaged, report.to_json()


def test_a_wrong_index_entry_inside_a_batch_is_repaired_from_its_neighbours(
        tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(6)]))
    cq = store.topics.queue("T", 0)
    pos, size, th, ts = cq.entry(3)
    cq.write_entry(3, INDEX_ENTRY.pack(pos + 5, size, th, ts))
    assert read(store, "T", 0, 3) == [(i, b"body-%d" % i) for i in range(3, 6)]
    assert cq.entry(3) == (pos, size, th, ts)
    store.close()


def test_a_batch_larger_than_a_segment_is_stored_message_by_message(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    parts = [encode_part(b"x" * 20_000, f"K{i}", i) for i in range(5)]
    res = store.put_batch("T", 0, encode_batch(parts))
    assert res.offsets == [0, 1, 2, 3, 4]
    assert [o for o, _b in read(store, "T", 0)] == [0, 1, 2, 3, 4]
    store.close()


def test_a_data_directory_written_before_batch_records_opens_reads_and_takes_them(
        tmp_path: Path) -> None:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    data = tmp_path / "store"
    seg_dir = data / "commitlog"
    versions = {n: FILE_HEADER.unpack((seg_dir / n).read_bytes()[:FILE_HEADER.size])[1]
                for n in sorted(os.listdir(seg_dir))}
    assert set(versions.values()) == {1}, versions  # all written by the older release
    clock = FakeClock(T0 + 100)
    store = open_store(data, clock)
    q0 = [(o, body(i, PAD)) for o, i in enumerate([*range(0, 60, 2), 60])]
    q1 = [(o, body(i, PAD)) for o, i in enumerate(range(1, 60, 2))]
    assert read(store, "orders", 0) == q0 and read(store, "orders", 1) == q1
    assert store.get_offset("g", "orders", 0) == 7
    # its active segment now says it may hold batch records; the sealed ones are untouched
    active = sorted(os.listdir(seg_dir))[-1]
    assert FILE_HEADER.unpack((seg_dir / active).read_bytes()[:FILE_HEADER.size]) [:2] == (
        LOG_MAGIC, 2)
    res = store.put_batch("orders", 1, encode_batch([msg(i) for i in range(100, 110)]))
    assert res.offsets == list(range(30, 40))
    assert store.put_batch("orders", 0, encode_batch([msg(4, "", PAD), msg(200)])
                           ).duplicates == [0]
    store.close()
    store = open_store(data, clock)
    assert read(store, "orders", 1) == q1 + [(30 + k, b"body-%d" % (100 + k))
                                             for k in range(10)]
    assert read(store, "orders", 0)[-1] == (31, b"body-200")
    store.close()
    assert not verify_store(str(data)).damaged


def test_an_entry_pointing_at_the_batch_before_its_own_is_repaired(tmp_path: Path) -> None:
    """Offset 5 is the first message of the second batch; its entry claims the first batch
    (which holds 0-4 only): the read must not take it for one of that batch's messages."""
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(5)]))
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(5, 10)]))
    cq = store.topics.queue("T", 0)
    right = cq.entry(5)
    pos, size, th, ts = cq.entry(0)
    cq.write_entry(5, INDEX_ENTRY.pack(pos, size, th, ts))
    want = [(i, b"body-%d" % i) for i in range(10)]
    assert read(store, "T", 0, 0) == want
    assert cq.entry(5) == right
    # every entry of the second batch claims the first: found in the log, repaired at once
    for k in range(5, 10):
        cq.write_entry(k, INDEX_ENTRY.pack(pos, size, th, ts))
    assert read(store, "T", 0, 0) == want
    assert cq.entry(5) == right
    store.close()
    assert not verify_store(str(tmp_path)).damaged


def test_a_pull_of_part_of_a_batch_sends_only_that_part(tmp_path: Path) -> None:
    """A pull that wants some messages of a batch record gets a batch record of those
    (checked end to end by its own checksums): a large batch is sent once over the pulls
    that take it in slices, and max_msgs holds."""
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put_batch("T", 0, encode_batch([msg(i, "a" if i % 2 else "", 100)
                                          for i in range(300)]))
    store.put("T", 0, [msg(300)])
    store.put_batch("T", 0, encode_batch([msg(i, "", 100) for i in range(301, 310)], "lz4"))
    whole = store.topics.queue("T", 0).entry(0)[1]
    r = store.get("T", 0, 10, 32, 1 << 20)
    assert (r.count, r.next_offset) == (32, 42)
    assert len(r.payload) < whole
    got = list(decode_records(r.payload))  # no filter needed: only what was pulled
    assert [(m.queue_offset, m.body, m.position) for m in got] == [
        (i, body(i, 100), 0) for i in range(10, 42)]
    hashes = frozenset([tag_hash("a")])
    r = store.get("T", 0, 0, 8, 1 << 20, hashes)
    assert (r.count, r.next_offset) == (4, 8)
    assert [m.queue_offset for m in decode_records(r.payload, True, 0, 8, hashes)] == [
        1, 3, 5, 7]
    sent = 0
    offset = 0
    while offset < 300:
        r = store.get("T", 0, offset, 32, 1 << 20)
        sent += len(r.payload)
        offset = r.next_offset
    assert sent < 1.2 * whole  # each message sent once (a header per slice)
    assert read(store, "T", 0, 0, 1) == [(i, body(i, 100)) for i in range(300)] + [
        (300, b"body-300")] + [(i, body(i, 100)) for i in range(301, 310)]
    r = store.get("T", 0, 303, 2, 1 << 20)  # a slice of a compressed batch: sent plain
    assert [m.queue_offset for m in decode_records(r.payload)] == [303, 304]
    store.close()


def test_pulls_fall_in_step_with_the_batches_and_send_each_whole(tmp_path: Path) -> None:
    """A pull that would end inside a batch record after other records leaves it to the
    next pull: after one short pull, pulls of a queue written in batches start at a batch's
    first message and send each batch record whole, as stored (no slice)."""
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put("T", 0, [msg(0)])  # a single message first: the batches start at offset 1
    for b in range(4):
        store.put_batch("T", 0, encode_batch([msg(1 + 10 * b + i) for i in range(10)]))
    cq = store.topics.queue("T", 0)
    stored = [cq.entry(1 + 10 * b)[:2] for b in range(4)]  # (position, size) of each batch
    r = store.get("T", 0, 0, 10, 1 << 20)
    assert (r.count, r.next_offset) == (1, 1)  # not 10: the batch would be cut at 9 of 10
    offset, payloads = 1, []
    while offset < 41:
        r = store.get("T", 0, offset, 10, 1 << 20)
        assert r.count == 10 and r.next_offset == offset + 10
        payloads.append(r.payload)
        offset = r.next_offset
    for payload, (pos, size) in zip(payloads, stored, strict=True):
        assert payload == store.log.read(pos, size)  # the batch record as stored
    # one record only, cut by max_msgs: the pull takes what it may of it, a slice
    r = store.get("T", 0, 1, 4, 1 << 20)
    assert (r.count, r.next_offset) == (4, 5) and len(r.payload) < stored[0][1]
    # a tag filter reads entry by entry, up to max_msgs
    r = store.get("T", 0, 0, 10, 1 << 20, frozenset([tag_hash("")]))
    assert (r.count, r.next_offset) == (10, 10)
    store.close()


def test_a_damaged_batch_record_is_marked_damaged_whole_in_one_read(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(300)]))
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(300, 310)]))
    pos, size, _th, _ts = store.topics.queue("T", 0).entry(0)
    store.close()
    seg = sorted((tmp_path / "commitlog").iterdir())[0]
    raw = bytearray(seg.read_bytes())
    raw[FILE_HEADER.size + pos + size // 2] ^= 0xFF  # one byte inside the first batch
    seg.write_bytes(bytes(raw))
    store = open_store(tmp_path)
    r = store.get("T", 0, 0, 32, 1 << 20)
    assert (r.status, r.next_offset) == (PullStatus.DAMAGED, 300)
    assert read(store, "T", 0, 300) == [(i, b"body-%d" % i) for i in range(300, 310)]
    store.close()
    report = verify_store(str(tmp_path))
    assert [(d.first, d.last) for d in report.queues] == [(0, 299)]


def test_the_writers_scan_steps_over_a_batch_record_only_when_its_frame_checks(
        tmp_path: Path) -> None:
    """The scan for sequenced records skips batch records (they never carry the flag); a
    damaged size field of one must not make it skip the record after it."""
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    store.put_batch("T", 0, encode_batch([msg(i) for i in range(3)]))
    store.put("T", 0, [encode_part(b"s", "S1", 1, flags=SEQUENCED, properties={"w": "1"})])
    store.put("T", 0, [msg(50)])
    cq = store.topics.queue("T", 0)
    bpos, bsize, _th, _ts = cq.entry(0)
    spos, ssize, _th, _ts = cq.entry(3)
    assert [f[3] for f in scan_sequenced(store, 0)] == [spos]
    store.close()
    seg = next((tmp_path / "commitlog").iterdir())
    raw = bytearray(seg.read_bytes())
    raw[FILE_HEADER.size + bpos:FILE_HEADER.size + bpos + 4] = (bsize + ssize).to_bytes(
        4, "little")
    seg.write_bytes(bytes(raw))
    store = open_store(tmp_path)
    assert [f[3] for f in scan_sequenced(store, 0)] == [spos]
    store.close()
