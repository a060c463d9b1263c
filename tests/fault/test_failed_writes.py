"""A failed write leaves no trace: sends, topic creation and deletion under injected errors.

Each test makes one step fail (``EMFILE``, ``ENOSPC`` or ``EIO`` from the Nth call of a file
operation), goes on with successful writes, then kills the store (no close, no checkpoint)
and opens it again: every acknowledged message is at its offset, no failed send is
readable, and the topics are the ones whose change was acknowledged.
"""

from __future__ import annotations

import errno
import os
import random
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.broker.store_errors import error_code
from onceq.log.record import decode_records, encode_part
from onceq.protocol.codes import PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.storage.config import StoreConfig
from onceq.storage.errors import StorageError
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.faultfiles import FaultFiles
from tests.helpers import kill_store as kill

SEG = 64 * 1024  # ~190 records of BODY bytes: the sends roll segments
PER_FILE = 50  # index entries per file: the sends create index files
BODY = 300
T0 = 1_700_000_000.0
ERRNOS = [errno.EMFILE, errno.ENOSPC, errno.EIO]
QUEUES = 2

# the steps of a send: (operation, path part)
SEND_STEPS = {
    "log-write": ("pwrite", "commitlog"),
    "segment-open": ("open", "commitlog"),
    "segment-fsync": ("fsync", "commitlog"),
    "segment-dir-fsync": ("fsync_dir", "commitlog"),
    "index-create": ("open", "queues"),
    "index-append": ("pwrite", "queues"),
}


def open_store(root: str, files: FaultFiles, clock: FakeClock | None = None) -> MessageStore:
    cfg = StoreConfig(root, segment_size=SEG, index_entries_per_file=PER_FILE,
                      max_body=8 * 1024)
    store = MessageStore(cfg, clock=clock or FakeClock(T0), files=files)
    store.open()
    return store




class Ledger:
    """What the producer was told: acknowledged messages and failed sends."""

    def __init__(self) -> None:
        self.acked: dict[str, tuple[str, int, int]] = {}  # uk -> (topic, queue, offset)
        self.failed: set[str] = set()
        self.codes: list[ErrorCode] = []
        self.failed_queues: set[tuple[str, int]] = set()
        self.n = 0

    def send(self, store: MessageStore, topic: str, queue: int, count: int) -> bool:
        uks = [f"UK{self.n + i:06d}" for i in range(count)]
        self.n += count
        parts = [encode_part(f"{uk}".encode().ljust(BODY, b"."), uk, 1) for uk in uks]
        try:
            r = store.put(topic, queue, parts)
        except StorageError as exc:
            self.failed.update(uks)
            self.codes.append(error_code(exc))
            self.failed_queues.add((topic, queue))
            return False
        assert not r.duplicates
        for uk, off in zip(uks, r.offsets, strict=True):
            self.acked[uk] = (topic, queue, off)
        return True


def read_all(store: MessageStore) -> dict[str, tuple[str, int, int]]:
    """Every readable message: uk -> (topic, queue, offset); offsets are contiguous."""
    out: dict[str, tuple[str, int, int]] = {}
    for (topic, qid), cq in sorted(store.queues.items()):
        off = cq.min_offset
        while off < cq.max_offset:
            r = store.get(topic, qid, off, 64, 1 << 20)
            assert r.status == PullStatus.FOUND, (topic, qid, off, r.status)
            for m in decode_records(r.payload):
                assert m.queue_offset == off
                assert m.unique_key not in out, f"{m.unique_key} stored twice"
                out[m.unique_key] = (topic, qid, off)
                off += 1
    return out


def check(store: MessageStore, ledger: Ledger) -> None:
    got = read_all(store)
    assert not ledger.failed & set(got), "a failed send is readable"
    assert got == ledger.acked  # every acknowledged message at its offset, nothing else


def expected_code(err: int) -> ErrorCode:
    return ErrorCode.DISK_FULL if err == errno.ENOSPC else ErrorCode.STORAGE_ERROR


def run_sends(root: str, op: str, where: str, nth: int, err: int, seed: int,
              same_queue: bool = True) -> Ledger:
    """Sends of 1-5 messages until the fault struck and 30 more sends; kill; reopen.

    ``same_queue``: the later sends go to any queue (else never to the failed one, whose
    failed records would then be its last)."""
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", QUEUES)
    rng = random.Random(seed)
    ledger = Ledger()
    for _ in range(20):
        assert ledger.send(store, "t", rng.randrange(QUEUES), rng.randint(1, 5))
    fault = files.arm(op, nth, err, where)
    after = 0
    while after < 30 and ledger.n < 3000:
        queue = rng.randrange(QUEUES)
        if not same_queue and ("t", queue) in ledger.failed_queues:
            queue = (queue + 1) % QUEUES
        ledger.send(store, "t", queue, rng.randint(1, 5))
        if fault.raised:
            after += 1
    assert fault.raised == 1, "the fault never struck"
    assert ledger.failed, "no send failed"
    assert set(ledger.codes) == {expected_code(err)}
    assert store.write_failure is None  # rolled back: writes go on
    check(store, ledger)  # live
    kill(store)
    again = open_store(root, FaultFiles())
    check(again, ledger)  # after a kill and a restart
    assert again.recovered_records > 0
    assert ledger.send(again, "t", 0, 2)
    again.close()
    return ledger


@pytest.mark.parametrize("same_queue", [True, False], ids=["then-same-queue", "then-others"])
@pytest.mark.parametrize("err", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("step", list(SEND_STEPS))
def test_failed_send_leaves_no_trace(tmp_path, step, err, same_queue):
    op, where = SEND_STEPS[step]
    nth = 3 if op in ("pwrite", "fsync") else 1
    run_sends(str(tmp_path), op, where, nth, err, seed=sum(map(ord, step)) + err,
              same_queue=same_queue)


def test_failed_send_then_success_keeps_the_acknowledged_offset(tmp_path):
    """The reported case: index append fails after the record reached the log, the next send
    to the queue succeeds, kill, restart: offset 0 is the acknowledged message."""
    files = FaultFiles()
    store = open_store(str(tmp_path), files)
    store.create_topic("t", 1)
    ledger = Ledger()
    files.arm("pwrite", 1, errno.EMFILE, "queues")
    assert not ledger.send(store, "t", 0, 1)
    assert ledger.send(store, "t", 0, 1)
    assert ledger.acked == {"UK000001": ("t", 0, 0)}
    kill(store)
    check(open_store(str(tmp_path), FaultFiles()), ledger)


def test_failed_send_does_not_enter_the_dedup_window(tmp_path):
    files = FaultFiles()
    store = open_store(str(tmp_path), files)
    store.create_topic("t", 1)
    part = encode_part(b"x", "RETRY-ME", 1)
    files.arm("pwrite", 1, errno.ENOSPC, "commitlog")
    with pytest.raises(StorageError) as ei:
        store.put("t", 0, [part])
    assert error_code(ei.value) == ErrorCode.DISK_FULL and "rolled back" in ei.value.message
    r = store.put("t", 0, [part])  # the producer's retry is stored, not a "duplicate"
    assert not r.duplicates and r.offsets == [0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.sampled_from(sorted(SEND_STEPS)), nth=st.integers(1, 40),
       err=st.sampled_from(ERRNOS), seed=st.integers(0, 1000), same_queue=st.booleans())
def test_property_any_failing_call_of_a_send(step, nth, err, seed, same_queue):
    op, where = SEND_STEPS[step]
    if op != "pwrite":
        nth = min(nth, 6)  # segment and index files are created a few times only
    with tempfile.TemporaryDirectory() as root:
        run_sends(root, op, where, nth, err, seed, same_queue)


@pytest.mark.parametrize("where", ["commitlog", "queues"])
def test_rollback_that_fails_stops_writes(tmp_path, where):
    """Disk gone: the write fails and so does its rollback. The store refuses every later
    write (no offset can be reused), reads go on, and a restart recovers."""
    files = FaultFiles()
    store = open_store(str(tmp_path), files)
    store.create_topic("t", 1)
    ledger = Ledger()
    for _ in range(5):
        assert ledger.send(store, "t", 0, 2)
    files.arm("pwrite", 1, errno.EIO, where, times=None)
    files.arm("ftruncate", 1, errno.EIO, where, times=None)
    assert not ledger.send(store, "t", 0, 1)
    assert store.write_failure is not None
    files.disarm()
    with pytest.raises(StorageError) as ei:
        store.put("t", 0, [encode_part(b"y", "AFTER", 1)])
    assert error_code(ei.value) == ErrorCode.STORAGE_ERROR and "restart" in ei.value.message
    with pytest.raises(StorageError):
        store.create_topic("u", 1)
    assert read_all(store) == ledger.acked  # reads go on, through no failed entry
    assert store.repair.damaged() == {"log": [], "queues": {}}
    kill(store)
    again = open_store(str(tmp_path), FaultFiles())
    got = read_all(again)
    assert {uk: got[uk] for uk in ledger.acked} == ledger.acked
    assert again.write_failure is None and ledger.send(again, "t", 0, 1)


# ================================================================ topics
TOPIC_STEPS = {
    "tmp-open": ("open", "topics.json.tmp"),
    "tmp-write": ("pwrite", "topics.json.tmp"),
    "tmp-fsync": ("fsync", "topics.json.tmp"),
    "rename": ("replace", "topics.json"),
    "dir-fsync": ("fsync_dir", None),  # the data directory: set per test
    "index-dir": ("makedirs", "queues"),
}


def _topic_fault(files: FaultFiles, root: str, step: str, err: int) -> None:
    op, where = TOPIC_STEPS[step]
    if where is None:
        files.arm(op, 1, err, lambda p: os.path.abspath(p) == os.path.abspath(root))
    else:
        files.arm(op, 1, err, where)


@pytest.mark.parametrize("err", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("step", list(TOPIC_STEPS))
def test_failed_topic_create_changes_nothing(tmp_path, step, err):
    root = str(tmp_path)
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", 2)
    ledger = Ledger()
    assert ledger.send(store, "t", 0, 3)
    _topic_fault(files, root, step, err)
    with pytest.raises(StorageError) as ei:
        store.create_topic("u", 4)
    assert error_code(ei.value) == expected_code(err)
    assert files.raised == 1
    assert "u" not in store.topics and not any(k[0] == "u" for k in store.queues)
    with pytest.raises(StorageError) as ei:
        store.put("u", 0, [encode_part(b"x", "X", 1)])
    assert error_code(ei.value) == ErrorCode.TOPIC_NOT_EXIST
    # growing a topic that fails keeps its queue count
    _topic_fault(files, root, step, err)
    with pytest.raises(StorageError):
        store.create_topic("t", 3)
    assert store.topics["t"].queues == 2 and ("t", 2) not in store.queues
    files.disarm()
    store.create_topic("v", 1)  # a later change succeeds
    assert ledger.send(store, "v", 0, 2) and ledger.send(store, "t", 1, 2)
    kill(store)
    again = open_store(root, FaultFiles())
    assert sorted(again.topics) == ["t", "v"] and again.topics["t"].queues == 2
    assert not os.path.exists(os.path.join(root, "queues", "u"))
    check(again, ledger)


@pytest.mark.parametrize("err", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("step", [s for s in TOPIC_STEPS if s != "index-dir"])
def test_failed_topic_delete_changes_nothing(tmp_path, step, err):
    root = str(tmp_path)
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", 2)
    ledger = Ledger()
    assert ledger.send(store, "t", 0, 3) and ledger.send(store, "t", 1, 2)
    _topic_fault(files, root, step, err)
    with pytest.raises(StorageError) as ei:
        store.delete_topic("t")
    assert error_code(ei.value) == expected_code(err)
    assert "t" in store.topics
    files.disarm()
    check(store, ledger)  # live: still there with its messages
    assert ledger.send(store, "t", 0, 1)
    kill(store)
    again = open_store(root, FaultFiles())
    assert sorted(again.topics) == ["t"]
    check(again, ledger)


@pytest.mark.parametrize("op", ["unlink", "rmdir", "listdir"])
def test_topic_delete_whose_index_removal_fails(tmp_path, op):
    """The table is written first: the delete holds; leftover index files go at next open."""
    root = str(tmp_path)
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", 2)
    store.create_topic("keep", 1)
    ledger = Ledger()
    assert ledger.send(store, "t", 0, 3) and ledger.send(store, "keep", 0, 2)
    files.arm(op, 1, errno.EMFILE, os.path.join("queues", "t"), times=None)
    store.delete_topic("t")
    assert "t" not in store.topics and not any(k[0] == "t" for k in store.queues)
    files.disarm()
    ledger.acked = {uk: v for uk, v in ledger.acked.items() if v[0] != "t"}
    kill(store)
    again = open_store(root, FaultFiles())
    assert sorted(again.topics) == ["keep"]
    assert not os.path.exists(os.path.join(root, "queues", "t"))
    check(again, ledger)


def test_table_rename_not_durable_and_not_restorable_stops_writes(tmp_path):
    root = str(tmp_path)
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", 1)
    files.arm("fsync_dir", 1, errno.EIO, lambda p: os.path.abspath(p) == os.path.abspath(root),
              times=None)
    with pytest.raises(StorageError) as ei:
        store.create_topic("u", 1)
    assert error_code(ei.value) == ErrorCode.STORAGE_ERROR
    assert "u" not in store.topics
    assert store.write_failure is not None  # the table on disk is uncertain: stop writing
    files.disarm()
    with pytest.raises(StorageError):
        store.put("t", 0, [encode_part(b"x", "X", 1)])
    assert store.get("t", 0, 0, 1, 1 << 20).status == PullStatus.NO_NEW_MESSAGE


# ================================================================ disk usage limit
def test_usage_ratio_refuses_writes_and_resumes(tmp_path):
    root = str(tmp_path)
    files = FaultFiles()
    clock = FakeClock(T0)
    store = open_store(root, files, clock)
    store.create_topic("t", 1)
    store.create_topic("gone", 1)
    ledger = Ledger()
    assert ledger.send(store, "t", 0, 2)
    files.usage = (1000, 50)  # 95% used, above 0.90
    clock.advance(1.1)
    with pytest.raises(StorageError) as ei:
        store.put("t", 0, [encode_part(b"x", "X", 1)])
    assert error_code(ei.value) == ErrorCode.DISK_FULL and ei.value.retriable
    with pytest.raises(StorageError) as ei:
        store.create_topic("u", 1)
    assert error_code(ei.value) == ErrorCode.DISK_FULL
    # reads, offset commits and deletes (which free space) go on
    check(store, ledger)
    store.commit_offset("g", "t", 0, 1)
    assert store.get_offset("g", "t", 0) == 1
    store.delete_topic("gone")
    files.usage = (1000, 500)
    with pytest.raises(StorageError):  # measured at most once a second
        store.put("t", 0, [encode_part(b"x", "X", 1)])
    clock.advance(1.1)
    assert ledger.send(store, "t", 0, 1)  # space is back: accepted without a restart
    store.close()


# ================================================================ failed fsync (broker)
@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_failed_fsync_stops_writes(tmp_path, flush):
    """Never retried: sync rolls back the unacknowledged send and answers STORAGE_ERROR;
    async keeps what it acknowledged. Both refuse writes until a restart; reads go on."""
    from onceq import Admin, Producer
    from onceq.client.message import Message
    from onceq.client.pull import PullConsumer
    from tests.helpers import running_broker

    async def bodies(addr: str) -> list[bytes]:
        async with PullConsumer(addr, "r") as c:
            r = await c.pull("T", 0, 0, 100)
            return [m.body for m in r.messages]

    files = FaultFiles()
    async with running_broker(str(tmp_path), {"flush": flush}, files=files) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr, retries=0) as p:
            await p.send("T", Message(b"one"), queue=0)
            if flush == "async":
                await b.flusher.flush_now()
            fault = files.arm("fsync", 1, errno.EIO, "commitlog")
            if flush == "sync":
                with pytest.raises(OnceqError) as ei:
                    await p.send("T", Message(b"two"), queue=0)
                assert ei.value.code == ErrorCode.STORAGE_ERROR
                assert "not acknowledged" in ei.value.message
            else:
                await p.send("T", Message(b"two"), queue=0)  # acknowledged from page cache
                with pytest.raises(OSError):
                    await b.flusher.flush_now()
            assert fault.raised == 1
            with pytest.raises(OnceqError) as ei:
                await p.send("T", Message(b"three"), queue=0)
            assert ei.value.code == ErrorCode.STORAGE_ERROR and "restart" in ei.value.message
        async with Admin(addr) as admin:
            w = (await admin.broker_status())["writes"]
        assert not w["accepted"] and "restart" in w["reason"]
        kept = [b"one"] if flush == "sync" else [b"one", b"two"]
        assert await bodies(addr) == kept
    # never fsynced again hoping for a success, not even at stop (sync: one fsync of the
    # log once cut back, which makes the removal durable)
    assert fault.seen == (2 if flush == "sync" else 1)
    async with running_broker(str(tmp_path), {"flush": flush}) as b:
        addr = f"127.0.0.1:{b.port}"
        assert await bodies(addr) == kept
        async with Producer(addr, retries=0) as p:
            r = await p.send("T", Message(b"four"), queue=0)
        assert r.offset == len(kept)


def test_send_back_refused_and_scheduled_retries_wait_on_a_full_disk(tmp_path):
    """Send-backs are writes (refused with DISK_FULL); a due retry that cannot be delivered
    waits for space instead of being dropped."""
    from onceq.broker.retry import SCHEDULE_GROUP, RetryService, parse_delay_levels
    from onceq.protocol.codes import SCHEDULE_TOPIC, retry_topic

    files = FaultFiles()
    clock = FakeClock(T0)
    store = open_store(str(tmp_path), files, clock)
    store.create_topic("t", 1)
    woken: list[tuple[str, int]] = []
    retry = RetryService(store, parse_delay_levels("1s 5s"), clock,
                         lambda t, q: woken.append((t, q)))
    store.put("t", 0, [encode_part(b"a", "A", 1), encode_part(b"b", "B", 1)])
    retry.send_back("g", "t", 0, 0, 1, 16)  # stored in the schedule topic, due in 1 s
    files.usage = (1000, 10)
    clock.advance(1.5)
    with pytest.raises(StorageError) as ei:
        retry.send_back("g", "t", 0, 1, 1, 16)
    assert error_code(ei.value) == ErrorCode.DISK_FULL
    assert retry.deliver_due() <= 1.0  # due, not deliverable: tried again within a second
    assert store.min_max(retry_topic("g"), 0) == (0, 0)
    assert store.get_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, 0) <= 0  # not consumed
    files.usage = (1000, 900)
    clock.advance(1.5)
    retry.deliver_due()
    assert store.min_max(retry_topic("g"), 0) == (0, 1)  # delivered once space is back
    assert store.get_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, 0) == 1


def test_damaged_record_read_on_a_full_disk(tmp_path):
    """Marking a damaged record needs a small write; on a full disk the pull still answers
    DAMAGED (the marker is in the index entry) instead of failing."""
    from onceq.log.segment import FILE_HEADER_SIZE

    root = str(tmp_path)
    files = FaultFiles()
    store = open_store(root, files)
    store.create_topic("t", 1)
    r = store.put("t", 0, [encode_part(b"a" * BODY, f"K{i}", 1) for i in range(3)])
    pos, size, _th, _ts = store.queues[("t", 0)].entry(1)
    with open(os.path.join(root, "commitlog", f"{0:020d}"), "r+b") as f:
        f.seek(FILE_HEADER_SIZE + pos + size // 2)
        f.write(b"\xff" * 8)
    files.arm("pwrite", 1, errno.ENOSPC, "damaged.json", times=None)
    got = store.get("t", 0, 1, 10, 1 << 20)
    assert got.status == PullStatus.DAMAGED and got.next_offset == 2
    assert r.offsets == [0, 1, 2]
    assert store.get("t", 0, 2, 10, 1 << 20).status == PullStatus.FOUND
    files.disarm()
    kill(store)
    again = open_store(root, FaultFiles())
    assert again.repair.damaged()["queues"] == {"t": {"0": [[1, 2]]}}
