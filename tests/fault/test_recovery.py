"""Crash and damage recovery of the message store.

A workload is written over several topics and queues with small segments and small index
files, the store is closed or dropped as in a crash (the page cache keeps the writes; no
checkpoint, no offsets file), the files are damaged, and the store is reopened. Then:

* every message whose record does not overlap the damage is readable at its original
  offset with identical content, and nothing else is (nothing is invented); the offsets of
  damaged records are pulled as DAMAGED (later records and segments are all kept), except
  a torn write at the very end of the log, which is cut;
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
from onceq.storage.metadata import decode_checkpoint
from onceq.storage.store import MessageStore
from onceq.storage.verify import verify_store
from tests.clock import FakeClock
from tests.helpers import kill_store as crash

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


def read_queue(store: MessageStore, topic: str, qid: int, damaged: list | None = None
               ) -> list:
    """Every readable message of a queue; offsets pulled as DAMAGED go to ``damaged``."""
    lo, hi = store.min_max(topic, qid)
    offset, out = lo, []
    while True:
        res = store.get(topic, qid, offset, 5, 1 << 20)
        if res.status == PullStatus.NO_NEW_MESSAGE:
            assert offset == hi
            return out
        if res.status == PullStatus.DAMAGED:
            assert damaged is not None, (topic, qid, offset)
            assert res.next_offset > offset and res.count == 0
            damaged.extend(range(offset, res.next_offset))
            offset = res.next_offset
            continue
        assert res.status == PullStatus.FOUND
        msgs = list(decode_records(res.payload))
        assert [m.queue_offset for m in msgs] == list(range(offset, offset + len(msgs)))
        out.extend(msgs)
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
@dataclass
class Expect:
    """What a damage costs: records overlapping ``lost`` byte ranges are lost (skipped as
    damaged, or cut with a torn tail); records ending after ``cut`` are cut; records before
    ``head`` went with a deleted first segment."""

    lost: list[tuple[int, int]]
    cut: int | None = None
    head: int = 0


def damage(kind: str, root: str, written: list[Written], data) -> Expect:
    segs = segment_files(root)
    if kind == "truncate_last_segment":
        base, path = segs[-1]
        cut = data.draw(st.integers(0, os.path.getsize(path) - 1), label="cut")
        os.truncate(path, cut)
        return Expect([], cut=base + max(0, cut - FILE_HEADER_SIZE))
    if kind == "flip_byte":
        base, path = data.draw(st.sampled_from(segs), label="segment")
        i = data.draw(st.integers(0, os.path.getsize(path) - 1), label="index")
        with open(path, "r+b") as f:
            f.seek(i)
            b = f.read(1)[0]
            f.seek(i)
            f.write(bytes([b ^ data.draw(st.integers(1, 255), label="xor")]))
        if i < FILE_HEADER_SIZE:  # a damaged file header is rewritten: nothing lost
            return Expect([])
        return Expect([(base + i - FILE_HEADER_SIZE, base + i - FILE_HEADER_SIZE + 1)])
    if kind == "zero_range":
        base, path = data.draw(st.sampled_from(segs), label="segment")
        size = os.path.getsize(path) - FILE_HEADER_SIZE
        if size <= 0:
            return Expect([])
        i = data.draw(st.integers(0, size - 1), label="start")
        n = data.draw(st.integers(1, min(3000, size - i)), label="length")
        with open(path, "r+b") as f:
            f.seek(FILE_HEADER_SIZE + i)
            before = f.read(n)
            f.seek(FILE_HEADER_SIZE + i)
            f.write(bytes(n))
        # only the bytes that were not zero already are damaged
        return Expect([(base + i + j, base + i + j + 1) for j, b in enumerate(before) if b])
    if kind == "append_garbage":
        with open(segs[-1][1], "ab") as f:
            f.write(data.draw(st.binary(min_size=1, max_size=500), label="garbage"))
        return Expect([])
    if kind == "zero_tail":  # a crash that extended the file but lost the data
        with open(segs[-1][1], "ab") as f:
            f.write(bytes(data.draw(st.integers(1, 5000), label="zeros")))
        return Expect([])
    if kind == "delete_queue_dir":
        topic = data.draw(st.sampled_from(sorted(TOPICS)), label="topic")
        qid = data.draw(st.integers(0, TOPICS[topic] - 1), label="qid")
        shutil.rmtree(os.path.join(root, "queues", topic, str(qid)))
        return Expect([])
    if kind == "delete_checkpoint":
        os.unlink(os.path.join(root, "checkpoint"))
        return Expect([])
    if kind == "truncate_index_file":
        path = data.draw(st.sampled_from(index_files(root)), label="index file")
        os.truncate(path, data.draw(st.integers(0, os.path.getsize(path)), label="cut"))
        return Expect([])
    if kind == "corrupt_checkpoint":
        with open(os.path.join(root, "checkpoint"), "r+b") as f:
            f.write(b"\xff\xff")
        return Expect([])
    if kind == "delete_middle_segment":  # a lost file: its records only are lost
        i = data.draw(st.integers(1, len(segs) - 2), label="segment")
        os.unlink(segs[i][1])
        return Expect([(segs[i][0], segs[i + 1][0])])
    if kind == "delete_first_segment":
        os.unlink(segs[0][1])
        return Expect([], head=segs[1][0])
    raise AssertionError(kind)


KINDS = [
    "truncate_last_segment", "flip_byte", "zero_range", "append_garbage", "zero_tail",
    "delete_queue_dir",
    "delete_checkpoint", "truncate_index_file", "corrupt_checkpoint", "delete_first_segment",
    "delete_middle_segment",
]


def check_state(store: MessageStore, survivors: dict, expect_range: dict,
                damaged: dict) -> None:
    for key, msgs in survivors.items():
        topic, qid = key
        assert store.min_max(topic, qid) == expect_range[key], key
        bad: list[int] = []
        got = read_queue(store, topic, qid, bad)
        assert bad == damaged[key], key
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


def expectations(written: list[Written], exp: Expect, checkpoint: int | None):
    """Per queue: readable records, offset range and damaged offsets after recovery."""
    def overlaps(w: Written) -> bool:
        return any(w.position < b and a < w.end for a, b in exp.lost)

    last = max(written, key=lambda w: w.position)
    torn = set()
    damaged_ids = set()
    for w in written:
        if exp.cut is not None and w.end > exp.cut:
            torn.add(id(w))
        elif overlaps(w):
            # the last record of the log, unchecked by a checkpoint: a torn write, cut
            if w is last and (checkpoint is None or w.position >= checkpoint):
                torn.add(id(w))
            else:
                damaged_ids.add(id(w))
    keys = [(t, q) for t, n in TOPICS.items() for q in range(n)]
    survivors, expect_range, damaged = {}, {}, {}
    for k in keys:
        mine = [w for w in written if (w.topic, w.queue_id) == k]
        kept = [w for w in mine if w.position >= exp.head and id(w) not in torn]
        survivors[k] = [w for w in kept if id(w) not in damaged_ids]
        damaged[k] = [w.offset for w in kept if id(w) in damaged_ids]
        if kept:
            # what is kept forms one contiguous run of offsets
            assert [w.offset for w in kept] == list(range(kept[0].offset, kept[-1].offset + 1))
            expect_range[k] = (kept[0].offset, kept[-1].offset + 1)
        elif exp.head > 0:  # the head was lost: the queue is empty at its old end
            expect_range[k] = (len(mine), len(mine))
        else:  # the tail was cut: the queue restarts where its kept records end
            expect_range[k] = (0, 0)
    lost = [w for w in written if id(w) in torn or id(w) in damaged_ids
            or w.position < exp.head]
    return survivors, expect_range, damaged, lost


def read_checkpoint(root: str) -> int | None:
    try:
        with open(os.path.join(root, "checkpoint"), "rb") as f:
            return decode_checkpoint(f.read())
    except FileNotFoundError:
        return None


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
        checkpoint = read_checkpoint(root)
        exp = damage(kind, root, written, data)
        clock.t += 10
        survivors, expect_range, damaged, lost = expectations(written, exp, checkpoint)
        keys = list(survivors)

        store = open_store(root, clock)
        check_state(store, survivors, expect_range, damaged)

        # the dedup window knows exactly the surviving messages
        kept = [w for k in keys for w in survivors[k]]
        if kept:
            w = rng.choice(kept)
            res = store.put(w.topic, (w.queue_id + 1) % TOPICS[w.topic], [w.part])
            assert res.duplicates == [0] and res.offsets == [w.offset]
            assert res.duplicate_queues == [w.queue_id]
        if lost and exp.head == 0:  # a lost message sent again is stored again
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
        check_state(store, survivors, expect_range, damaged)

        # stable across another clean reopen and another crash
        store.close()
        store = open_store(root, clock)
        check_state(store, survivors, expect_range, damaged)
        crash(store)
        store = open_store(root, clock)
        check_state(store, survivors, expect_range, damaged)
        store.close()
        # the offline verifier names the same damaged offsets, and no other index problem
        report = verify_store(root)
        assert {(d.topic, d.queue_id, o) for d in report.queues
                for o in range(d.first, d.last + 1)} == {
            (t, q, o) for (t, q), offs in damaged.items() for o in offs}


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
