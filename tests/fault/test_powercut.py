"""Power cuts (``tests/powercut.py``: only what was fsynced survives, the cut falls between
any two fsyncs) with the store driven as the broker drives it: the log flushed off the loop
while sends go on, checkpoints whose index fsyncs run off the loop while sends and log
flushes go on.

* A restart after a power cut reads only the log after the last checkpoint, as after a
  SIGKILL: the checkpoint never counts index entries that its fsync did not cover.
* A power cut loses at most a clean suffix of each queue: whatever was durable at the last
  completed flush survives (in ``sync`` mode, every acknowledged send), and what survives
  of a queue is offsets 0..n-1 with no gap, its index agreeing with the log.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from onceq.log.record import REC_HEADER_SIZE, decode_records, encode_part
from onceq.protocol.codes import PullStatus
from onceq.storage.commitlog import fsync_all
from onceq.storage.config import StoreConfig
from onceq.storage.files import FileOps
from onceq.storage.store import MessageStore
from onceq.storage.verify import verify_store
from tests.clock import FakeClock
from tests.faultfiles import CountingFiles
from tests.helpers import kill_store
from tests.powercut import PowerCutFiles

SEG = 64 * 1024
PER_FILE = 50
QUEUES = 3
T0 = 1_700_000_000.0


def open_store(root: str, files: FileOps, flush: str = "async", t: float = T0
               ) -> MessageStore:
    store = MessageStore(StoreConfig(root, segment_size=SEG, index_entries_per_file=PER_FILE,
                                     max_body=8 * 1024, flush=flush),
                         clock=FakeClock(t), files=files)
    store.open()
    return store


class Driver:
    """A store on a power-cut model, driven as the broker drives it (``broker/flush.py``,
    ``Broker._checkpoint``); the work the event loop does while a flush or a checkpoint
    runs off the loop is run from the model's ``after_fsync`` hook."""

    def __init__(self, root: str, files: PowerCutFiles, flush: str = "async") -> None:
        self.files = files
        self.store = open_store(root, files, flush)
        if "T" not in self.store.topics:
            self.store.create_topic("T", QUEUES)
        self.written: dict[int, list[tuple[str, int]]] = {q: [] for q in range(QUEUES)}
        self.flushed = self.store.log.end  # durable below: the last flush that completed
        self.n = 0
        self.checkpointed = -1  # the log end of the last checkpoint

    def put(self, q: int, n: int = 1, size: int = 300) -> None:
        uks = [f"U{self.n + i:07d}" for i in range(n)]
        self.n += n
        parts = [encode_part(uk.encode().ljust(size, b"."), uk, 1) for uk in uks]
        sizes = [REC_HEADER_SIZE + 1 + len(p) for p in parts]
        r = self.store.put("T", q, parts)
        assert r.offsets == list(range(len(self.written[q]), len(self.written[q]) + n))
        end = r.end_position - sum(sizes)  # a batch's records are contiguous in the log
        for uk, size in zip(uks, sizes, strict=True):
            end += size
            self.written[q].append((uk, end))

    def _during(self, work: Callable[[], None]) -> None:
        """Run ``work`` after the next fsync (the loop going on while files are fsynced
        off the loop); after the last one (``_finish``) if none happens."""
        done = []

        def hook(_path: str) -> None:
            self.files.after_fsync = None
            done.append(1)
            work()

        self.files.after_fsync = hook
        self._pending = (done, work)

    def _finish(self) -> None:
        done, work = self._pending
        self.files.after_fsync = None
        if not done:
            work()

    def flush(self, during: Callable[[], None] | None = None) -> None:
        """``Flusher.flush_now``: take the dirty segments, fsync them off the loop."""
        log_ = self.store.log
        target = log_.end
        targets = log_.take_dirty()
        log_.syncing = True  # a roll meanwhile keeps the sealed descriptor open
        if during is not None:
            self._during(during)
        fsync_all(self.store.files, targets)
        if during is not None:
            self._finish()
        log_.syncing = False
        log_.release_retired()
        if not self.files.cut:
            self.flushed = max(self.flushed, target)

    def checkpoint(self, during: Callable[[], None] | None = None) -> None:
        """``Broker._checkpoint``: the log end and the dedup chunk on the loop, the log
        flushed, the dirty index files taken on the loop, then ``checkpoint_at`` off it."""
        store = self.store
        end = self.checkpointed = store.log.end
        chunk = store.checkpoints.dedup_chunk(end)
        self.flush()
        index_files = store.checkpoints.dirty_index_files()
        if during is not None:
            self._during(during)
        store.checkpoints.checkpoint_at(end, index_files, chunk)
        if during is not None:
            self._finish()

    def crash(self) -> None:
        kill_store(self.store)


def check_after_cut(root: str, d: Driver, flush: str) -> MessageStore:
    """Reopen after the cut; every queue holds a prefix of what was written, all of what was
    durable at the last completed flush, no damage, and the index agrees with the log."""
    store = open_store(root, PowerCutFiles(), flush)
    for q in range(QUEUES):
        lo, hi = store.min_max("T", q)
        assert lo == 0, (q, lo)
        got = []
        off = 0
        while off < hi:
            r = store.get("T", q, off, 64, 1 << 20)
            assert r.status == PullStatus.FOUND, (q, off, r.status)
            msgs = list(decode_records(r.payload))
            got.extend((m.queue_offset, m.unique_key) for m in msgs)
            off = r.next_offset
        assert got == [(o, d.written[q][o][0]) for o in range(hi)], q  # a prefix, no gap
        durable = sum(1 for _uk, end in d.written[q] if end <= d.flushed)
        assert hi >= durable, (q, hi, durable)  # nothing durable (sync: acknowledged) lost
    assert store.repair.damaged() == {"log": [], "queues": {}}
    report = verify_store(root)
    assert report.log == [] and report.queues == [], (report.log, report.queues)
    for q in range(QUEUES):  # the next send continues the queue
        hi = store.min_max("T", q)[1]
        assert store.put("T", q, [encode_part(b"after", f"AFTER{q}", 1)]).offsets == [hi]
    return store


def test_restart_after_a_power_cut_reads_only_the_log_after_the_checkpoint(tmp_path, caplog):
    """The checkpoint's index fsyncs run off the loop while sends go on. After a power cut,
    the restart must not rebuild the indexes from the whole log: it scans the log after the
    checkpoint only and reads about as many bytes as that tail holds, as after a SIGKILL."""
    root = str(tmp_path)
    files = PowerCutFiles()
    d = Driver(root, files)
    for i in range(600):
        d.put(i % QUEUES, 1, 400)
    # two sends per queue while the checkpoint fsyncs the index files
    d.checkpoint(during=lambda: [d.put(q, 2) for q in range(QUEUES)])
    d.put(0, 5)
    d.flush()
    tail = d.store.log.end - d.checkpointed
    d.crash()
    files.cut_power()
    counting = CountingFiles()
    with caplog.at_level(logging.INFO, logger="onceq.storage"):
        store = open_store(root, counting, t=T0 + 600)  # the data is older than the window
    assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]
    assert store.recovered_records == 3 * 2 + 5  # only the records after the checkpoint
    assert store.log.end - store.log.start > 250_000
    assert counting.read < tail + 64 * len(store.log.segments) + 8192, (counting.read, tail)
    assert [store.min_max("T", q) for q in range(QUEUES)] == [(0, 207), (0, 202), (0, 202)]
    store.close()


def _roll_unflushed(d: Driver) -> None:
    """Sends until the log rolls to a new segment that holds some records: the sealed
    segment's tail and the new segment's records are unflushed."""
    segments = len(d.store.log.segments)
    i = 0
    while len(d.store.log.segments) == segments or d.store.log.segments[-1].size < 3000:
        d.put(i % QUEUES, 1, 700)
        i += 1


def test_a_cut_inside_the_flush_of_a_roll_loses_only_a_suffix(tmp_path):
    """One flush covers the sealed segment's tail and the new segment: a cut after its
    first fsync must not leave the new segment's records behind a hole."""
    root = str(tmp_path)
    files = PowerCutFiles()
    d = Driver(root, files)
    for i in range(100):
        d.put(i % QUEUES, 1, 500)
    d.flush()
    _roll_unflushed(d)
    files.cut_after = files.events + 1  # the power goes after the flush's first fsync
    d.flush()
    assert files.cut
    d.crash()
    files.cut_power()
    check_after_cut(root, d, "async").close()


def test_a_cut_before_the_flush_of_a_roll_leaves_no_gap_in_the_log(tmp_path):
    """The sealed segment lost its unflushed tail and the new one holds only its header:
    the lost tail is not damage, and the log goes on without a gap."""
    root = str(tmp_path)
    files = PowerCutFiles()
    d = Driver(root, files)
    for i in range(100):
        d.put(i % QUEUES, 1, 500)
    d.checkpoint()
    _roll_unflushed(d)
    files.cut_now()
    d.crash()
    files.cut_power()
    store = check_after_cut(root, d, "async")
    store.close()
    store = open_store(root, PowerCutFiles())  # the log has no gap at the next start either
    assert store.repair.damaged() == {"log": [], "queues": {}}
    assert [s.base for s in store.log.segments[1:]] == [s.end for s in store.log.segments[:-1]]
    store.close()


def _run(root: str, flush: str, steps: list, cut: tuple[str, float] | None
         ) -> tuple[Driver, PowerCutFiles]:
    """Run ``steps``; ``cut``: ("step", f) cuts the power before the step at fraction f of
    the run, ("event", f) after the fsync (or rename, unlink) at fraction f of the run's."""
    files = PowerCutFiles()
    d = Driver(root, files, flush)
    at_step = None
    if cut is not None and cut[0] == "event":
        files.cut_after = files.events + 1 + int(cut[1] * cut_span(root, flush, steps))
    elif cut is not None:
        at_step = int(cut[1] * len(steps))
    for i, step in enumerate(steps):
        if i == at_step:
            files.cut_now()
        kind = step[0]
        if kind == "put":
            d.put(*step[1:])
        elif kind == "roll":
            _roll_unflushed(d)
        else:
            sends = step[1]

            def during(sends=sends, also_flush=kind == "checkpoint" and step[2]) -> None:
                for i in range(sends):
                    d.put(i % QUEUES, 2, 500)
                if also_flush:  # the background flush runs while the checkpoint does
                    d.flush()

            if kind == "flush":
                d.flush(during)
            else:
                d.checkpoint(during)
    return d, files


def cut_span(root: str, flush: str, steps: list) -> int:
    """The events of the run after the store opened (a dry run in a directory of its own)."""
    with tempfile.TemporaryDirectory() as dry:
        d, files = _run(dry, flush, steps, None)
        d.crash()
        opened = PowerCutFiles()
        Driver(os.path.join(dry, "x"), opened).crash()
        return max(1, files.events - opened.events)


step_st = st.one_of(
    st.tuples(st.just("put"), st.integers(0, QUEUES - 1), st.sampled_from([1, 3, 8]),
              st.sampled_from([100, 1500, 6000])),
    st.tuples(st.just("roll")),  # sends until the log rolls to a new segment
    st.tuples(st.just("flush"), st.integers(0, 3)),  # sends while its fsyncs run
    # sends, and a log flush, while its index fsyncs run
    st.tuples(st.just("checkpoint"), st.integers(0, 3), st.booleans()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flush=st.sampled_from(["sync", "async"]),
       steps=st.lists(step_st, min_size=1, max_size=30),
       cut=st.tuples(st.sampled_from(["step", "event"]), st.floats(0, 1)))
@example(flush="async", steps=[("put", 0, 6, 3000)] * 6 + [("flush", 2)] + [
    ("put", 1, 6, 3000)] * 12 + [("checkpoint", 3, True)], cut=("event", 0.5))
def test_a_power_cut_anywhere_loses_at_most_a_clean_suffix(flush, steps, cut):
    root = tempfile.mkdtemp(prefix="onceq-cut-")
    try:
        d, files = _run(root, flush, steps, cut)
        d.crash()
        files.cut_power()
        check_after_cut(root, d, flush).close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
