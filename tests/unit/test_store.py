"""MessageStore: commit log + consume queues + topics + consumer offsets + dedup window."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from onceq.broker.store_errors import error_code
from onceq.log.record import REC_HEADER_SIZE, decode_records, encode_part, tag_hash
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode
from onceq.storage.config import StoreConfig
from onceq.storage.errors import StorageError
from onceq.storage.store import MessageStore
from tests.clock import FakeClock

SEG = 64 * 1024
PER_FILE = 7
T0 = 1_700_000_000.0


def open_store(path, clock=None, **kw) -> MessageStore:
    cfg = dict(segment_size=SEG, index_entries_per_file=PER_FILE, max_body=8 * 1024)
    cfg.update(kw)
    store = MessageStore(StoreConfig(str(path), **cfg), clock=clock or FakeClock(T0))
    store.open()
    return store


def part(i: int, *, tags: str = "", uk: str | None = None, size: int | None = None,
         rng: random.Random | None = None) -> bytes:
    body = (f"m{i}:".encode() + bytes(range(256)) * 40)[: size if size is not None else 40]
    if rng is not None:
        body = rng.randbytes(size or 40)
    return encode_part(body, uk if uk is not None else f"UK{i:010d}", 1000 + i, tags=tags,
                       keys=f"order-{i} k{i}", properties={"i": str(i), "ü": "ß"})


def read_all(store: MessageStore, topic: str, qid: int, start: int | None = None,
             max_msgs: int = 32, max_bytes: int = 1 << 30, tag_hashes=None) -> list:
    lo, hi = store.min_max(topic, qid)
    offset = lo if start is None else start
    out = []
    while True:
        res = store.get(topic, qid, offset, max_msgs, max_bytes, tag_hashes)
        if res.status == PullStatus.NO_NEW_MESSAGE:
            assert res.next_offset == hi
            return out
        assert res.status == PullStatus.FOUND, res
        msgs = list(decode_records(res.payload))
        assert len(msgs) == res.count
        assert res.next_offset > offset
        for m in msgs:
            assert offset <= m.queue_offset < res.next_offset
        out.extend(msgs)
        offset = res.next_offset


def codes(exc_info) -> ErrorCode:
    """The wire code a client gets for the store error raised."""
    return error_code(exc_info.value)


# ================================================================== put / get
def test_put_get_across_segment_rolls_and_index_files(tmp_path):
    rng = random.Random(1)
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 3)
    written: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    ids = itertools.count()
    for _ in range(120):
        qid = rng.randrange(3)
        n = rng.randint(1, 5)
        parts = [part(next(ids), size=rng.randint(0, 3000), rng=rng) for _ in range(n)]
        res = store.put("T", qid, parts)
        assert res.queue_id == qid
        assert res.offsets == list(range(len(written[qid]), len(written[qid]) + n))
        assert res.duplicates == []
        assert res.end_position == store.log.end
        written[qid].extend(parts)
        clock.advance(0.01)
    assert len(store.log.segments) >= 5
    for qid in range(3):
        qdir = os.path.join(tmp_path, "queues", "T", str(qid))
        assert len(os.listdir(qdir)) >= 3  # several index files

    def check(store):
        for qid, parts in written.items():
            assert store.min_max("T", qid) == (0, len(parts))
            for max_msgs, max_bytes in ((1, 1 << 30), (5, 1 << 30), (32, 1 << 30), (32, 4000)):
                msgs = read_all(store, "T", qid, max_msgs=max_msgs, max_bytes=max_bytes)
                assert [m.queue_offset for m in msgs] == list(range(len(parts)))
                for m, p in zip(msgs, parts, strict=True):
                    assert m.topic == "T" and m.queue_id == qid
                    assert encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys,
                                       m.properties) == p
                    head_size = REC_HEADER_SIZE + 1 + len(p)
                    assert store.log.read(m.position, head_size)  # position is real

    check(store)
    store.close()
    store = open_store(tmp_path, clock)
    check(store)
    res = store.put("T", 0, [part(99_999)])
    assert res.offsets == [len(written[0])]
    store.close()


def test_get_respects_max_msgs_and_max_bytes(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    parts = [part(i, size=1000) for i in range(40)]
    store.put("T", 0, parts)
    size = len(next(decode_records(store.get("T", 0, 0, 1, 1 << 20).payload)).body)
    assert size == 1000
    # max_msgs, crossing index files of 7 entries
    res = store.get("T", 0, 3, 20, 1 << 30)
    assert res.status == PullStatus.FOUND and res.count == 20 and res.next_offset == 23
    assert [m.queue_offset for m in decode_records(res.payload)] == list(range(3, 23))
    # max_bytes: whole records only, at least one
    rec_size = len(store.get("T", 0, 0, 1, 1 << 30).payload)
    res = store.get("T", 0, 0, 32, rec_size * 3 + 10)
    assert res.count == 3 and len(res.payload) == rec_size * 3 and res.next_offset == 3
    res = store.get("T", 0, 5, 32, 1)
    assert res.count == 1 and res.next_offset == 6
    assert (res.min_offset, res.max_offset) == (0, 40)


def test_get_statuses(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 2)
    res = store.get("T", 0, 0, 32, 1 << 20)
    assert (res.status, res.count, res.next_offset, res.payload) == (
        PullStatus.NO_NEW_MESSAGE, 0, 0, b"")
    res = store.get("T", 0, 1, 32, 1 << 20)
    assert res.status == PullStatus.OFFSET_ILLEGAL and res.next_offset == 0
    store.put("T", 0, [part(i) for i in range(5)])
    assert store.get("T", 0, 5, 32, 1 << 20).status == PullStatus.NO_NEW_MESSAGE
    res = store.get("T", 0, 6, 32, 1 << 20)
    assert res.status == PullStatus.OFFSET_ILLEGAL and res.next_offset == 5
    res = store.get("T", 0, -1, 32, 1 << 20)
    assert res.status == PullStatus.OFFSET_MOVED and res.next_offset == 0
    res = store.get("T", 0, 4, 32, 1 << 20)
    assert res.status == PullStatus.FOUND and res.count == 1 and res.next_offset == 5
    assert store.get("T", 1, 0, 32, 1 << 20).status == PullStatus.NO_NEW_MESSAGE


def test_tag_filtering(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    tags = ["A", "B", "", "A", "C", "B", "A"] * 6 + ["B"] * 20
    store.put("T", 0, [part(i, tags=t) for i, t in enumerate(tags)])
    a = frozenset({tag_hash("A")})
    got = read_all(store, "T", 0, tag_hashes=a, max_msgs=4)
    assert [m.queue_offset for m in got] == [i for i, t in enumerate(tags) if t == "A"]
    assert all(m.tags == "A" for m in got)
    ab = frozenset({tag_hash("A"), tag_hash("C")})
    got = read_all(store, "T", 0, tag_hashes=ab)
    assert [m.queue_offset for m in got] == [i for i, t in enumerate(tags) if t in "AC" and t]
    # a pull whose whole window is filtered out still makes progress
    last_a = max(i for i, t in enumerate(tags) if t == "A")
    res = store.get("T", 0, last_a + 1, 32, 1 << 20, a)
    assert res.count == 0 and res.status == PullStatus.NO_NEW_MESSAGE
    assert res.next_offset == len(tags)
    res = store.get("T", 0, last_a + 1, 5, 1 << 20, a)
    assert res.count == 0 and res.next_offset == last_a + 6
    assert res.status in (PullStatus.FOUND, PullStatus.NO_NEW_MESSAGE)
    none = frozenset({tag_hash("nope")})
    assert read_all(store, "T", 0, tag_hashes=none) == []
    # no filter: everything
    assert len(read_all(store, "T", 0)) == len(tags)


# ================================================================== search by time
def test_search_offset_by_timestamp(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 2)
    stamps = []
    for i in range(30):
        store.put("T", 0, [part(i)])
        stamps.append(int(clock() * 1000))
        clock.advance(1.5 if i % 3 else 0.0)  # some equal store times
    assert store.reader.search_offset("T", 0, 0) == 0
    assert store.reader.search_offset("T", 0, stamps[0]) == 0
    assert store.reader.search_offset("T", 0, stamps[-1] + 1) == 30
    for ts in {*stamps, *(s + 1 for s in stamps), *(s - 1 for s in stamps)}:
        expect = next((i for i, s in enumerate(stamps) if s >= ts), 30)
        assert store.reader.search_offset("T", 0, ts) == expect, ts
    assert store.reader.search_offset("T", 1, stamps[5]) == 0  # empty queue
    msgs = read_all(store, "T", 0)
    assert [m.store_ts_ms for m in msgs] == stamps
    store.close()
    store = open_store(tmp_path, clock)
    assert store.reader.search_offset("T", 0, stamps[10]) == stamps.index(stamps[10])


def test_store_timestamps_never_go_backwards(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 1)
    for step in (0, 10, -5, 1, -30, 2):
        clock.advance(step)
        store.put("T", 0, [part(int(clock.t))])
    stamps = [m.store_ts_ms for m in read_all(store, "T", 0)]
    assert stamps == sorted(stamps)
    for ts in stamps:
        assert stamps[store.reader.search_offset("T", 0, ts)] == ts
    store.close()
    clock.advance(-100)  # restart with the clock behind the log
    store = open_store(tmp_path, clock)
    store.put("T", 0, [part(777)])
    later = [m.store_ts_ms for m in read_all(store, "T", 0)]
    assert later == sorted(later)


# ================================================================== retention
def test_retention_by_bytes_and_offset_moved(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock, retention_bytes=3 * SEG, retention_hours=0)
    store.create_topic("T", 2)
    store.create_topic("Quiet", 1)
    store.put("Quiet", 0, [part(i) for i in range(PER_FILE * 2)])  # exactly 2 full files
    for n in range(200):
        store.put("T", n % 2, [part(n, size=2000)])
        clock.advance(1)
    segs_before = len(store.log.segments)
    deleted = store.run_retention()
    assert deleted > 0 and len(store.log.segments) == segs_before - deleted
    assert sum(s.size for s in store.log.segments) <= 3 * SEG
    for qid in range(2):
        lo, hi = store.min_max("T", qid)
        assert 0 < lo < hi == 100
        res = store.get("T", qid, 0, 32, 1 << 20)
        assert res.status == PullStatus.OFFSET_MOVED and res.next_offset == lo
        assert res.min_offset == lo
        res = store.get("T", qid, lo - 1, 32, 1 << 20)
        assert res.status == PullStatus.OFFSET_MOVED and res.next_offset == lo
        first = next(decode_records(store.get("T", qid, lo, 1, 1 << 20).payload))
        assert first.queue_offset == lo and first.position >= store.log.start
        assert store.reader.search_offset("T", qid, 0) == lo
        assert [m.queue_offset for m in read_all(store, "T", qid)] == list(range(lo, hi))
    # the quiet queue lost every record: empty, but its offsets are not reused
    assert store.min_max("Quiet", 0) == (PER_FILE * 2, PER_FILE * 2)
    assert store.get("Quiet", 0, 0, 32, 1 << 20).status == PullStatus.OFFSET_MOVED
    mins = {q: store.min_max("T", q) for q in range(2)}
    store.close()
    for _ in range(2):  # reopen twice: stable
        store = open_store(tmp_path, clock, retention_bytes=3 * SEG, retention_hours=0)
        assert {q: store.min_max("T", q) for q in range(2)} == mins
        assert store.min_max("Quiet", 0) == (PER_FILE * 2, PER_FILE * 2)
        store.close()
    store = open_store(tmp_path, clock, retention_bytes=3 * SEG, retention_hours=0)
    assert store.put("T", 0, [part(5000)]).offsets == [100]
    assert store.put("Quiet", 0, [part(5001)]).offsets == [PER_FILE * 2]
    res = store.get("Quiet", 0, PER_FILE * 2, 32, 1 << 20)
    assert res.count == 1 and res.status == PullStatus.FOUND
    store.close()
    store = open_store(tmp_path, clock)
    assert store.min_max("Quiet", 0) == (PER_FILE * 2, PER_FILE * 2 + 1)
    store.close()


def test_retention_by_age(tmp_path):
    import time

    clock = FakeClock(time.time())
    store = open_store(tmp_path, clock, retention_hours=1)
    store.create_topic("T", 1)
    for i in range(100):
        store.put("T", 0, [part(i, size=2000)])
    assert len(store.log.segments) > 2
    assert store.run_retention() == 0
    clock.advance(2 * 3600)
    n = len(store.log.segments)
    assert store.run_retention() == n - 1
    assert len(store.log.segments) == 1  # the active segment is never deleted
    lo, hi = store.min_max("T", 0)
    assert hi == 100 and lo > 0
    assert [m.queue_offset for m in read_all(store, "T", 0)] == list(range(lo, hi))


def test_an_empty_queue_restarts_at_a_later_offset_and_keeps_it(tmp_path):
    """A queue moved here from a group where retention removed its head (``COPY_QUEUE``):
    its next message gets the offset asked for, also after a restart; a queue holding
    messages, or a lower offset, is refused."""
    store = open_store(tmp_path)
    store.create_topic("T", 2)
    store.put("T", 0, [part(0)])
    for queue, offset in ((0, 5), (1, -1)):
        with pytest.raises(StorageError) as err:
            store.restart_queue("T", queue, offset)
        assert error_code(err.value) == ErrorCode.INVALID_ARGUMENT
    store.restart_queue("T", 1, 12)
    assert store.min_max("T", 1) == (12, 12)
    assert store.put("T", 1, [part(1), part(2)]).offsets == [12, 13]
    store.close()
    store = open_store(tmp_path)
    assert store.min_max("T", 1) == (12, 14)
    assert [m.queue_offset for m in read_all(store, "T", 1)] == [12, 13]
    store.close()


# ================================================================== dedup window
def test_dedup_retry_returns_first_offsets_and_stores_nothing(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 2)
    store.create_topic("U", 1)
    first = store.put("T", 0, [part(0), part(1), part(2)])
    assert first.offsets == [0, 1, 2] and first.duplicates == []
    end = store.log.end
    again = store.put("T", 0, [part(1)])
    assert again.offsets == [1] and again.duplicates == [0]
    assert again.duplicate_queues == [0]
    assert store.log.end == end and store.min_max("T", 0) == (0, 3)
    # a retry sent to another queue reports where the first copy is
    other = store.put("T", 1, [part(2)])
    assert other.duplicates == [0] and other.duplicate_queues == [0] and other.offsets == [2]
    assert store.min_max("T", 1) == (0, 0)
    # mixed batch: new, dup, new, and a key repeated inside the batch
    mixed = store.put("T", 0, [part(10), part(0), part(11), part(10)])
    assert mixed.offsets == [3, 0, 4, 3]
    assert mixed.duplicates == [1, 3] and mixed.duplicate_queues == [0, 0]
    assert [m.unique_key for m in read_all(store, "T", 0)] == [
        "UK0000000000", "UK0000000001", "UK0000000002", "UK0000000010", "UK0000000011"]
    # the window is per topic; empty unique keys are never deduplicated
    assert store.put("U", 0, [part(0)]).duplicates == []
    assert store.put("U", 0, [part(50, uk=""), part(51, uk="")]).offsets == [1, 2]
    assert store.put("U", 0, [part(50, uk="")]).duplicates == []

    def assert_dups(store):
        res = store.put("T", 1, [part(0), part(11), part(12)])
        assert res.duplicates == [0, 1] and res.duplicate_queues == [0, 0]
        assert res.offsets[:2] == [0, 4]
        return res

    store.close()
    clock.advance(30)
    store = open_store(tmp_path, clock)  # window rebuilt from the log
    assert assert_dups(store).offsets[2] == 0
    # crash (no close, no checkpoint): still rebuilt
    clock.advance(30)
    store2 = open_store(tmp_path, clock)
    res = store2.put("T", 1, [part(12), part(13)])
    assert res.duplicates == [0] and res.offsets == [0, 1]
    store.log.close()
    store2.close()


def test_dedup_window_expires(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock, dedup_window_s=120)
    store.create_topic("T", 1)
    store.put("T", 0, [part(0)])
    clock.advance(119)
    assert store.put("T", 0, [part(0)]).duplicates == [0]
    clock.advance(2)
    res = store.put("T", 0, [part(0)])
    assert res.duplicates == [] and res.offsets == [1]
    # the new copy opens a new window
    clock.advance(60)
    assert store.put("T", 0, [part(0)]).offsets == [1]
    store.close()
    clock.advance(30)  # 90 s after the second copy: still inside its window after reopen
    store = open_store(tmp_path, clock, dedup_window_s=120)
    assert store.put("T", 0, [part(0)]).duplicates == [0]
    store.close()
    clock.advance(31)  # now outside every window
    store = open_store(tmp_path, clock, dedup_window_s=120)
    assert store.put("T", 0, [part(0)]).offsets == [2]
    store.close()


def test_dedup_two_copies_of_a_key_in_the_log(tmp_path):
    """A key stored twice (window grown across a restart) expires with its newest copy."""
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock, dedup_window_s=10)
    store.create_topic("T", 1)
    store.put("T", 0, [part(0)])
    clock.advance(15)
    assert store.put("T", 0, [part(0)]).offsets == [1]  # outside the 10 s window
    store.close()
    clock.advance(5)
    store = open_store(tmp_path, clock, dedup_window_s=120)
    assert store.put("T", 0, [part(0)]).offsets == [1]  # newest copy
    clock.advance(105)  # the first copy is 125 s old, the second 110 s
    res = store.put("T", 0, [part(0)])
    assert res.duplicates == [0] and res.offsets == [1]
    clock.advance(11)
    assert store.put("T", 0, [part(0)]).offsets == [2]
    store.close()


def test_dedup_disabled(tmp_path):
    store = open_store(tmp_path, dedup_window_s=0)
    store.create_topic("T", 1)
    assert store.put("T", 0, [part(0), part(0)]).offsets == [0, 1]
    assert store.put("T", 0, [part(0)]).offsets == [2]


def test_dedup_max_keys_bounds_memory(tmp_path):
    store = open_store(tmp_path, dedup_max_keys=10)
    store.create_topic("T", 1)
    store.put("T", 0, [part(i) for i in range(30)])
    assert len(store.dedup) <= 10
    assert store.put("T", 0, [part(29)]).duplicates == [0]  # newest keys are kept
    assert store.put("T", 0, [part(0)]).duplicates == []  # oldest forgotten


def test_rejected_put_leaves_no_trace_in_dedup(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    with pytest.raises(StorageError):
        store.put("T", 0, [part(0), part(1, size=9000)])
    assert store.put("T", 0, [part(0)]).duplicates == []


# ================================================================== consumer offsets
def test_consumer_offsets_persist(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 4)
    store.put("T", 0, [part(i) for i in range(20)])  # offsets within the queues' ends
    store.put("T", 3, [part(100 + i) for i in range(5)])
    assert store.get_offset("g1", "T", 0) == -1
    store.commit_offset("g1", "T", 0, 17)
    store.commit_offset("g1", "T", 3, 5)
    store.commit_offset("g2", "T", 0, 2)
    store.commit_offset("g1", "T", 0, 18)
    assert store.get_offset("g1", "T", 0) == 18
    store.close()
    store = open_store(tmp_path)
    assert store.get_offset("g1", "T", 0) == 18
    assert store.get_offset("g1", "T", 3) == 5
    assert store.get_offset("g2", "T", 0) == 2
    assert store.get_offset("g2", "T", 1) == -1
    with pytest.raises(StorageError) as ei:
        store.commit_offset("bad group", "T", 0, 1)
    assert codes(ei) == ErrorCode.INVALID_NAME
    with pytest.raises(StorageError) as ei:
        store.commit_offset("g1", "Nope", 0, 1)
    assert codes(ei) == ErrorCode.TOPIC_NOT_EXIST
    with pytest.raises(StorageError) as ei:
        store.get_offset("g1", "T", 4)
    assert codes(ei) == ErrorCode.INVALID_QUEUE
    store.offsets.save()
    store.delete_topic("T")
    store.create_topic("T", 4)
    assert store.get_offset("g1", "T", 0) == -1
    store.close()
    store = open_store(tmp_path)
    assert store.get_offset("g1", "T", 0) == -1
    store.close()


# ================================================================== topics
def test_topic_create_update_delete(tmp_path):
    store = open_store(tmp_path)
    t = store.create_topic("T", 2)
    assert t.queues == 2 and store.get_topic("T") is store.topics["T"]
    store.put("T", 1, [part(0)])
    assert store.create_topic("T", 2).queues == 2  # same count: no-op
    assert store.create_topic("T", 5).queues == 5  # grow
    assert store.min_max("T", 1) == (0, 1)  # existing queue untouched
    assert store.put("T", 4, [part(1)]).offsets == [0]
    with pytest.raises(StorageError) as ei:
        store.create_topic("T", 3)
    assert codes(ei) == ErrorCode.INVALID_ARGUMENT
    for bad in (0, -1, 1025, "3", 2.0, None):
        with pytest.raises(StorageError) as ei:
            store.create_topic("X", bad)
        assert codes(ei) == ErrorCode.INVALID_ARGUMENT
    assert "X" not in store.topics
    store.close()
    store = open_store(tmp_path)
    assert store.topics["T"].queues == 5
    assert store.min_max("T", 4) == (0, 1)
    store.close()


def test_deleted_topic_records_do_not_reappear(tmp_path):
    clock = FakeClock(T0)
    store = open_store(tmp_path, clock)
    store.create_topic("T", 3)
    store.create_topic("Other", 1)
    for q in range(3):
        store.put("T", q, [part(q * 100 + i) for i in range(10)])
    store.put("Other", 0, [part(9000)])
    store.delete_topic("T")
    with pytest.raises(StorageError) as ei:
        store.get_topic("T")
    assert codes(ei) == ErrorCode.TOPIC_NOT_EXIST
    with pytest.raises(StorageError) as ei:
        store.get("T", 0, 0, 32, 1 << 20)
    assert codes(ei) == ErrorCode.TOPIC_NOT_EXIST
    assert not os.path.exists(os.path.join(tmp_path, "queues", "T"))
    store.create_topic("T", 2)
    for q in range(2):
        assert store.min_max("T", q) == (0, 0)
    # the dedup keys of the old topic are gone too
    assert store.put("T", 0, [part(0)]).offsets == [0]

    def check(store):
        assert store.topics["T"].queues == 2
        assert [m.unique_key for m in read_all(store, "T", 0)] == ["UK0000000000"]
        assert read_all(store, "T", 1) == []
        assert [m.unique_key for m in read_all(store, "Other", 0)] == ["UK0000009000"]

    check(store)
    store.close()
    store = open_store(tmp_path, clock)
    check(store)
    # crash after delete + recreate: no checkpoint covers the new topic
    store.delete_topic("T")
    store.create_topic("T", 3)
    store.put("T", 2, [part(1)])
    store.log.close()
    for cq in store.queues.values():
        cq.close()
    store = open_store(tmp_path, clock)
    assert [store.min_max("T", q) for q in range(3)] == [(0, 0), (0, 0), (0, 1)]
    assert [m.unique_key for m in read_all(store, "T", 2)] == ["UK0000000001"]
    # recreate with more queues than the first incarnation had
    store.delete_topic("T")
    store.create_topic("T", 8)
    store.close()
    store = open_store(tmp_path, clock)
    assert all(store.min_max("T", q) == (0, 0) for q in range(8))
    store.close()


@pytest.mark.parametrize(
    "name", ["", "a b", "x" * 128, "é", "a/b", "..\\x", None, 5, "t\n", ".", ".."]
)
def test_invalid_names(tmp_path, name):
    store = open_store(tmp_path)
    for call in (
        lambda: store.create_topic(name, 1),
        lambda: store.get_topic(name),
        lambda: store.put(name, 0, [part(0)]),
        lambda: store.get(name, 0, 0, 1, 1),
        lambda: store.delete_topic(name),
    ):
        with pytest.raises(StorageError) as ei:
            call()
        assert codes(ei) == ErrorCode.INVALID_NAME
    store.create_topic("T", 1)
    with pytest.raises(StorageError) as ei:
        store.commit_offset(name, "T", 0, 1)
    assert codes(ei) == ErrorCode.INVALID_NAME


def test_valid_names(tmp_path):
    store = open_store(tmp_path)
    for name in ("a", "x" * 127, "%RETRY%group-1", "%DLQ%g", "a.b|c_d-e"):
        store.create_topic(name, 1)
        assert store.put(name, 0, [part(0)]).offsets == [0]
        store.commit_offset(name, name, 0, 1)
    store.close()
    store = open_store(tmp_path)
    assert store.get_offset("%RETRY%group-1", "%RETRY%group-1", 0) == 1


# ================================================================== rejected puts
def test_put_errors_store_nothing(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 2)
    store.put("T", 0, [part(0)])
    end = store.log.end

    def rejected(code, topic, qid, parts):
        with pytest.raises(StorageError) as ei:
            store.put(topic, qid, parts)
        assert codes(ei) == code
        assert store.log.end == end
        assert store.min_max("T", 0) == (0, 1) and store.min_max("T", 1) == (0, 0)

    rejected(ErrorCode.TOPIC_NOT_EXIST, "Nope", 0, [part(1)])
    rejected(ErrorCode.INVALID_NAME, "bad name", 0, [part(1)])
    rejected(ErrorCode.INVALID_QUEUE, "T", 2, [part(1)])
    rejected(ErrorCode.INVALID_QUEUE, "T", -1, [part(1)])
    rejected(ErrorCode.MESSAGE_TOO_LARGE, "T", 0, [part(1), part(2, size=8 * 1024 + 1)])
    rejected(ErrorCode.BAD_REQUEST, "T", 0, [part(1), part(2)[:-1]])
    rejected(ErrorCode.BAD_REQUEST, "T", 0, [part(1), b""])
    rejected(ErrorCode.BAD_REQUEST, "T", 1, [part(1), part(2) + b"x"])
    # metadata so large that the record cannot fit a segment
    huge = encode_part(b"x", "HUGE", 0, tags="t" * 60000, keys="k" * 60000)
    rejected(ErrorCode.MESSAGE_TOO_LARGE, "T", 1, [part(1), huge])
    # exactly max_body is fine, and the store is still consistent after the rejections
    res = store.put("T", 0, [part(1), part(2, size=8 * 1024)])
    assert res.offsets == [1, 2]
    assert [m.queue_offset for m in read_all(store, "T", 0)] == [0, 1, 2]
    assert store.put("T", 1, [part(1)]).duplicates == [0]  # first copy from the put above
    store.close()
    store = open_store(tmp_path)
    assert [len(m.body) for m in read_all(store, "T", 0)] == [40, 40, 8 * 1024]
    store.close()


def test_large_batch_spanning_segments(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    parts = [part(i, size=7000) for i in range(40)]  # ~280 KiB in one put
    res = store.put("T", 0, parts)
    assert res.offsets == list(range(40))
    assert len(store.log.segments) >= 4
    assert [m.body for m in read_all(store, "T", 0)] == [
        (f"m{i}:".encode() + bytes(range(256)) * 40)[:7000] for i in range(40)]
    store.close()
    store = open_store(tmp_path)
    assert len(read_all(store, "T", 0)) == 40
    store.close()


def test_empty_put(tmp_path):
    store = open_store(tmp_path)
    store.create_topic("T", 1)
    res = store.put("T", 0, [])
    assert res.offsets == [] and res.duplicates == []


def test_config_validation(tmp_path):
    for kw in (dict(segment_size=1024), dict(max_body=SEG), dict(flush="never"),
               dict(index_entries_per_file=0), dict(retention_bytes=-1),
               dict(dedup_window_s=-1)):
        cfg = dict(segment_size=SEG, max_body=1024)
        cfg.update(kw)
        with pytest.raises(ValueError):
            MessageStore(StoreConfig(str(tmp_path), **cfg))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_queues_through_a_small_cache_of_open_index_files(tmp_path):
    """200 queues, 3 index files each, at most 4 index files open: every message is read
    back at its offset before and after a reopen, and open descriptors do not grow."""
    before = _open_fds()
    store = open_store(tmp_path, max_open_files=4)
    store.create_topic("many", 200)
    for round_ in range(3 * PER_FILE):
        for q in range(200):
            store.put("many", q, [part(round_ * 1000 + q)])
    assert len(store.open_files) <= 4
    assert len(store.log.segments) > 4  # sealed segments are opened through the cache too
    assert _open_fds() - before <= 4 + 1  # + the active segment's own descriptor
    for q in (0, 99, 199):
        assert [m.queue_offset for m in read_all(store, "many", q)] == list(range(3 * PER_FILE))
    store.write_checkpoint()
    store.close()
    assert _open_fds() == before
    store = open_store(tmp_path, max_open_files=4)
    for q in range(200):
        msgs = read_all(store, "many", q)
        assert msgs[0].body.startswith(f"m{q}:".encode())
        assert msgs[-1].body.startswith(f"m{(3 * PER_FILE - 1) * 1000 + q}:".encode())
        assert [m.queue_offset for m in msgs] == list(range(3 * PER_FILE))
    assert len(store.open_files) <= 4
    store.close()


def test_index_directories_made_ahead_are_best_effort(tmp_path):
    """``make_queue_dirs`` runs in a thread while the loop may delete the same topic: a
    directory it cannot make (ENOENT as its parent is moved away) is no error; the create
    that follows makes what is missing."""
    from onceq.storage.files import FileOps
    from tests.helpers import small_store

    class ParentMoved(FileOps):
        fail = True

        def makedirs(self, path: str) -> None:
            if self.fail and "/queues/t/" in path:
                raise FileNotFoundError(2, "No such file or directory", path)
            super().makedirs(path)

    files = ParentMoved()
    store = MessageStore(small_store(str(tmp_path / "d")), files=files)
    store.open()
    try:
        store.topics.make_queue_dirs("t", 0, 40)  # no error
        files.fail = False
        store.create_topic("t", 40)
        assert store.put("t", 39, [part(1)]).offsets == [0]
    finally:
        store.close()
