"""Crash and damage recovery of the message store.

A workload is written over several topics and queues with small segments and small index
files, the store is closed or dropped as in a crash (the page cache keeps the writes; no
checkpoint, no offsets file), the files are damaged, and the store is reopened. Then:

* every message whose record lies entirely before the damage is readable at its original
  offset with identical content, and nothing else is (nothing is invented);
* the next put of each queue continues right after the last surviving offset;
* the dedup window knows exactly the surviving messages;
* reopening again (cleanly or after another crash) gives the same state.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.log.record import REC_HEADER_SIZE, decode_records, encode_part
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.protocol.codes import PullStatus
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
from tests.clock import FakeClock

SEG = 64 * 1024
PER_FILE = 7
TOPICS = {"Alpha": 3, "B.b": 2, "%RETRY%g": 1}
T0 = 1_700_000_000.0


@dataclass
class Written:
    topic: str
    queue_id: int
    offset: int
    part: bytes
    unique_key: str
    position: int = -1

    @property
    def size(self) -> int:
        return REC_HEADER_SIZE + len(self.topic) + len(self.part)

    @property
    def end(self) -> int:
        return self.position + self.size


def open_store(path: str, clock: FakeClock) -> MessageStore:
    store = MessageStore(
        StoreConfig(path, segment_size=SEG, index_entries_per_file=PER_FILE, max_body=6000),
        clock=clock,
    )
    store.open()
    return store


def crash(store: MessageStore) -> None:
    """Drop the store as a killed process would: no checkpoint, no offsets, no fsync."""
    store.log.close()
    for cq in store.queues.values():
        cq.close()


def write_workload(store: MessageStore, rng: random.Random, clock: FakeClock) -> list[Written]:
    for name, n in TOPICS.items():
        store.create_topic(name, n)
    written: list[Written] = []
    counters = {(t, q): 0 for t, n in TOPICS.items() for q in range(n)}
    checkpoint_at = rng.randrange(100)
    for step in range(100):
        topic = rng.choice(list(TOPICS))
        qid = rng.randrange(TOPICS[topic])
        batch = []
        for _ in range(rng.randint(1, 4)):
            uk = f"UK{len(written) + len(batch):08d}"
            size = rng.choice((0, rng.randint(1, 100), rng.randint(100, 5000)))
            p = encode_part(rng.randbytes(size), uk, 1000 + step, tags=rng.choice("ABC"),
                            keys=f"k{step}", properties={"s": str(step)} if step % 2 else None)
            batch.append(Written(topic, qid, counters[topic, qid] + len(batch), p, uk))
        res = store.put(topic, qid, [w.part for w in batch])
        assert res.offsets == [w.offset for w in batch] and not res.duplicates
        counters[topic, qid] += len(batch)
        written.extend(batch)
        clock.t += 0.05
        if step == checkpoint_at:
            store.write_checkpoint()  # a crash later leaves a checkpoint mid-log
    # learn each record's position from the store itself
    for (topic, qid), n in counters.items():
        mine = [w for w in written if (w.topic, w.queue_id) == (topic, qid)]
        got = read_queue(store, topic, qid)
        assert [m.queue_offset for m in got] == list(range(n))
        for w, m in zip(mine, got, strict=True):
            assert m.unique_key == w.unique_key
            w.position = m.position
    assert len(store.log.segments) >= 3
    return written


def read_queue(store: MessageStore, topic: str, qid: int) -> list:
    lo, hi = store.min_max(topic, qid)
    offset, out = lo, []
    while True:
        res = store.get(topic, qid, offset, 5, 1 << 20)
        if res.status == PullStatus.NO_NEW_MESSAGE:
            assert offset == hi
            return out
        assert res.status == PullStatus.FOUND
        out.extend(decode_records(res.payload))
        offset = res.next_offset


def segment_files(root: str) -> list[tuple[int, str]]:
    d = os.path.join(root, "commitlog")
    return sorted((int(n), os.path.join(d, n)) for n in os.listdir(d) if n.isdigit())


def index_files(root: str) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(os.path.join(root, "queues")):
        out.extend(os.path.join(dirpath, f) for f in files)
    return sorted(out)


def record_at(written: list[Written], position: int) -> Written:
    return next(w for w in written if w.position <= position < w.end)


# ------------------------------------------------------------------ damage kinds
def damage(kind: str, root: str, written: list[Written], data) -> tuple[int, int]:
    """Damage the files; return the surviving range of commit-log positions [lo, hi)."""
    everything = (0, 1 << 62)
    segs = segment_files(root)
    if kind == "truncate_last_segment":
        base, path = segs[-1]
        cut = data.draw(st.integers(0, os.path.getsize(path) - 1), label="cut")
        os.truncate(path, cut)
        return 0, base + max(0, cut - FILE_HEADER_SIZE) if cut >= FILE_HEADER_SIZE else base
    if kind == "flip_byte":
        base, path = data.draw(st.sampled_from(segs), label="segment")
        i = data.draw(st.integers(0, os.path.getsize(path) - 1), label="index")
        with open(path, "r+b") as f:
            f.seek(i)
            b = f.read(1)[0]
            f.seek(i)
            f.write(bytes([b ^ data.draw(st.integers(1, 255), label="xor")]))
        if 10 <= i < 16:  # the header's reserved fields: not checked, nothing lost
            return everything
        if i < FILE_HEADER_SIZE:
            return 0, base
        return 0, record_at(written, base + i - FILE_HEADER_SIZE).position
    if kind == "append_garbage":
        with open(segs[-1][1], "ab") as f:
            f.write(data.draw(st.binary(min_size=1, max_size=500), label="garbage"))
        return everything
    if kind == "zero_tail":  # a crash that extended the file but lost the data
        with open(segs[-1][1], "ab") as f:
            f.write(bytes(data.draw(st.integers(1, 5000), label="zeros")))
        return everything
    if kind == "delete_queue_dir":
        topic = data.draw(st.sampled_from(sorted(TOPICS)), label="topic")
        qid = data.draw(st.integers(0, TOPICS[topic] - 1), label="qid")
        shutil.rmtree(os.path.join(root, "queues", topic, str(qid)))
        return everything
    if kind == "delete_checkpoint":
        os.unlink(os.path.join(root, "checkpoint"))
        return everything
    if kind == "truncate_index_file":
        path = data.draw(st.sampled_from(index_files(root)), label="index file")
        os.truncate(path, data.draw(st.integers(0, os.path.getsize(path)), label="cut"))
        return everything
    if kind == "corrupt_checkpoint":
        with open(os.path.join(root, "checkpoint"), "r+b") as f:
            f.write(b"\xff\xff")
        return everything
    if kind == "delete_first_segment":
        os.unlink(segs[0][1])
        return segs[1][0], 1 << 62
    raise AssertionError(kind)


KINDS = [
    "truncate_last_segment", "flip_byte", "append_garbage", "zero_tail", "delete_queue_dir",
    "delete_checkpoint", "truncate_index_file", "corrupt_checkpoint", "delete_first_segment",
]


def check_state(store: MessageStore, survivors: dict, expect_range: dict) -> None:
    for key, msgs in survivors.items():
        topic, qid = key
        assert store.min_max(topic, qid) == expect_range[key], key
        got = read_queue(store, topic, qid)
        assert len(got) == len(msgs), key
        for m, w in zip(got, msgs, strict=True):
            assert (m.topic, m.queue_id, m.queue_offset, m.position) == (
                w.topic, w.queue_id, w.offset, w.position)
            assert encode_part(m.body, m.unique_key, m.born_ts_ms, m.tags, m.keys,
                               m.properties, m.flags, m.reconsume_times) == w.part
        lo, hi = expect_range[key]
        if lo > 0:
            res = store.get(topic, qid, lo - 1, 1, 1 << 20)
            assert res.status == PullStatus.OFFSET_MOVED and res.next_offset == lo
        assert store.get(topic, qid, hi + 1, 1, 1 << 20).status == PullStatus.OFFSET_ILLEGAL


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(KINDS), crashed=st.booleans(),
       data=st.data())
def test_recovery_after_damage(seed, kind, crashed, data):
    rng = random.Random(seed)
    clock = FakeClock(T0)
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, clock)
        written = write_workload(store, rng, clock)
        if crashed:
            crash(store)
        else:
            store.close()
        lo, hi = damage(kind, root, written, data)
        clock.t += 10

        keys = [(t, q) for t, n in TOPICS.items() for q in range(n)]
        survivors = {k: [w for w in written if (w.topic, w.queue_id) == k
                         and lo <= w.position and w.end <= hi] for k in keys}
        expect_range = {}
        for k in keys:
            all_k = [w for w in written if (w.topic, w.queue_id) == k]
            s = survivors[k]
            if s:
                # survivors form one contiguous run of offsets
                assert [w.offset for w in s] == list(range(s[0].offset, s[-1].offset + 1))
                expect_range[k] = (s[0].offset, s[-1].offset + 1)
            elif lo > 0:  # the head was lost: the queue is empty at its old end
                expect_range[k] = (len(all_k), len(all_k))
            else:  # the tail was lost: the queue restarts where its survivors end
                expect_range[k] = (0, 0)

        store = open_store(root, clock)
        check_state(store, survivors, expect_range)

        # the dedup window knows exactly the surviving messages
        lost = [w for w in written if not (lo <= w.position and w.end <= hi)]
        kept = [w for w in written if lo <= w.position and w.end <= hi]
        if kept:
            w = rng.choice(kept)
            res = store.put(w.topic, (w.queue_id + 1) % TOPICS[w.topic], [w.part])
            assert res.duplicates == [0] and res.offsets == [w.offset]
            assert res.duplicate_queues == [w.queue_id]
        if lost and lo == 0:
            w = lost[0]
            res = store.put(w.topic, w.queue_id, [w.part])
            assert res.duplicates == [] and res.offsets == [expect_range[w.topic, w.queue_id][1]]
            survivors[w.topic, w.queue_id].append(
                Written(w.topic, w.queue_id, res.offsets[0], w.part, w.unique_key,
                        res.end_position - w.size))
            a, b = expect_range[w.topic, w.queue_id]
            expect_range[w.topic, w.queue_id] = (a, b + 1)

        # the next put of every queue continues right after its last offset
        for k in keys:
            topic, qid = k
            uk = f"NEW{topic}{qid}"
            p = encode_part(b"new " + uk.encode(), uk, 5, tags="N")
            res = store.put(topic, qid, [p])
            a, b = expect_range[k]
            assert res.offsets == [b] and not res.duplicates
            survivors[k].append(Written(topic, qid, b, p, uk, res.end_position - REC_HEADER_SIZE
                                        - len(topic) - len(p)))
            expect_range[k] = (a, b + 1)
        check_state(store, survivors, expect_range)

        # stable across another clean reopen and another crash
        store.close()
        store = open_store(root, clock)
        check_state(store, survivors, expect_range)
        crash(store)
        store = open_store(root, clock)
        check_state(store, survivors, expect_range)
        store.close()


def test_crash_without_any_checkpoint_reindexes_everything():
    rng = random.Random(7)
    clock = FakeClock(T0)
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, clock)
        written = write_workload(store, rng, clock)
        crash(store)
        for path in index_files(root):
            os.unlink(path)
        os.unlink(os.path.join(root, "checkpoint"))
        store = open_store(root, clock)
        assert store.recovered_records == len(written)
        for t, n in TOPICS.items():
            for q in range(n):
                mine = [w for w in written if (w.topic, w.queue_id) == (t, q)]
                assert [m.unique_key for m in read_queue(store, t, q)] == [
                    w.unique_key for w in mine]
        store.close()


def test_stale_index_entry_forces_a_full_rebuild():
    """An index entry that points at the wrong record is caught and the index rebuilt."""
    rng = random.Random(3)
    clock = FakeClock(T0)
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, clock)
        written = write_workload(store, rng, clock)
        store.close()
        # swap the last entry of a queue's index for a wrong position
        qdir = os.path.join(root, "queues", "Alpha", "0")
        last = sorted(os.listdir(qdir))[-1]
        path = os.path.join(qdir, last)
        size = os.path.getsize(path)
        if size > FILE_HEADER_SIZE:
            with open(path, "r+b") as f:
                f.seek(size - 24)
                f.write((7).to_bytes(8, "little"))
        store = open_store(root, clock)
        mine = [w for w in written if (w.topic, w.queue_id) == ("Alpha", 0)]
        assert [m.position for m in read_queue(store, "Alpha", 0)] == [w.position for w in mine]
        store.close()
