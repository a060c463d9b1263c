"""Committed offsets are journaled in the commit log: crashes and power cuts keep them."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest

from onceq import Admin, ErrorCode, OnceqError, Producer, PullConsumer
from onceq.broker.broker import Broker
from onceq.broker.config import BrokerConfig
from onceq.log.offset_record import OFFSETS_TOPIC
from onceq.log.record import encode_part
from onceq.log.segment import FILE_HEADER_SIZE
from onceq.protocol.codes import PullStatus
from onceq.storage.config import StoreConfig
from onceq.storage.files import OS_FILES, FileOps
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.faultfiles import FaultFiles
from tests.helpers import kill_store as crash
from tests.helpers import running_broker, small_store
from tests.powercut import PowerCutFiles

SEG = 64 * 1024
T0 = 1_700_000_000.0


def open_store(root: str, files: FileOps = OS_FILES, **kw) -> MessageStore:
    kw = {"segment_size": SEG, "index_entries_per_file": 100, "max_body": 8 * 1024, **kw}
    store = MessageStore(StoreConfig(root, **kw), clock=FakeClock(T0), files=files)
    store.open()
    return store




def fill(store: MessageStore, topic: str, queues: int, n: int, tag: str = "") -> None:
    for q in range(queues):
        store.put(topic, q, [encode_part(b"x" * 200, f"{topic}{tag}-{q}-{i}", 1)
                             for i in range(n)])


def snapshot_file(root: str) -> dict:
    with open(os.path.join(root, "offsets.json")) as f:
        return json.load(f)


def test_async_commits_survive_a_killed_process(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 4)
    fill(store, "T", 4, 50)
    expect = {}
    for step in range(200):  # several commits per queue, the last one counts
        q, off = step % 4, step // 4 + 1
        store.commit_offset("g", "T", q, off)
        expect[q] = off
    store.commit_offset("h", "T", 2, 7)
    crash(store)  # no close: no checkpoint and no offsets.json at all
    assert not os.path.exists(os.path.join(root, "offsets.json"))
    store = open_store(root)
    assert {q: store.get_offset("g", "T", q) for q in range(4)} == expect
    assert store.get_offset("h", "T", 2) == 7
    assert store.offsets.replayed == 201
    store.close()


def test_commits_carried_by_pulls_are_journaled_together(tmp_path):
    """A commit carried by a pull is set at once and journaled with the next batch: one
    record per changed queue, whatever the number of pulls; a kill after the batch keeps
    the last values, a kill before it keeps what was journaled before."""
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 2)
    fill(store, "T", 2, 50)
    store.commit_offset("g", "T", 0, 1)  # journaled at once (an explicit commit)
    journal = store.offsets.journal_end()
    for off in range(2, 41):
        store.offsets.commit_later("g", "T", 0, off)
        store.offsets.commit_later("g", "T", 1, off)
    assert store.get_offset("g", "T", 0) == 40  # visible at once
    assert store.offsets.journal_end() == journal  # nothing written per pull
    end = store.offsets.flush_pending()
    assert store.offsets.journal_end() == journal + 2
    assert end == store.log.end
    store.offsets.commit_later("g", "T", 1, 45)  # set, never journaled: lost with the kill
    crash(store)
    store = open_store(root)
    assert [store.get_offset("g", "T", q) for q in range(2)] == [40, 40]
    store.offsets.commit_later("g", "T", 0, 42)
    store.commit_offset("g", "T", 1, 43)  # an explicit commit takes the pending ones along
    crash(store)
    store = open_store(root)
    assert [store.get_offset("g", "T", q) for q in range(2)] == [42, 43]
    store.close()


def test_sync_commits_survive_a_power_cut_once_fsynced(tmp_path):
    """What a sync broker answers after: the log fsynced up to the commit's position."""
    root = str(tmp_path)
    files = PowerCutFiles()
    store = open_store(root, files, flush="sync")
    store.create_topic("T", 2)
    fill(store, "T", 2, 20)
    store.write_checkpoint()
    store.offsets.save()  # a snapshot covering the first commits
    store.commit_offset("g", "T", 0, 5)
    store.offsets.save()
    end = store.commit_offset("g", "T", 0, 9)
    end = store.commit_offset("g", "T", 1, 12)
    assert end == store.log.end
    store.log.sync()  # the fsync the flusher runs before answering
    unanswered = store.commit_offset("g", "T", 1, 15)  # written, never fsynced
    assert unanswered > end
    crash(store)
    files.cut_power()
    store = open_store(root, files, flush="sync")
    assert store.get_offset("g", "T", 0) == 9
    assert store.get_offset("g", "T", 1) == 12  # 15 was never answered: lost is allowed
    store.close()


def test_power_cut_model_loses_unsynced_commits(tmp_path):
    """The model bites: without the fsync the commits are gone (so the test above can fail)."""
    root = str(tmp_path)
    files = PowerCutFiles()
    store = open_store(root, files)
    store.create_topic("T", 1)
    fill(store, "T", 1, 20)
    store.write_checkpoint()
    store.commit_offset("g", "T", 0, 9)
    crash(store)
    files.cut_power()
    store = open_store(root, files)
    assert store.get_offset("g", "T", 0) == -1
    store.close()


def test_only_changes_are_journaled(tmp_path):
    store = open_store(str(tmp_path))
    store.create_topic("T", 1)
    fill(store, "T", 1, 10)
    first = store.commit_offset("g", "T", 0, 3)
    assert store.commit_offset("g", "T", 0, 3) == first  # unchanged: no record, same end
    store.commit_offset("g", "T", 0, 4)
    assert store.min_max(OFFSETS_TOPIC, 0) == (0, 2)
    store.close()


def test_snapshot_records_what_it_covers_and_replay_starts_after_it(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    fill(store, "T", 1, 10)
    store.commit_offset("g", "T", 0, 3)
    store.commit_offset("g", "T", 0, 4)
    store.offsets.save()
    assert snapshot_file(root) == {"format": 2, "covered": 2, "groups": {"g": {"T": {"0": 4}}}}
    store.commit_offset("g", "T", 0, 6)
    crash(store)
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == 6 and store.offsets.replayed == 1
    store.close()


def test_a_deleted_group_stays_deleted_across_a_kill_and_a_snapshot(tmp_path):
    """``DELETE_GROUP``: the deletion is a journal record replayed in its place (commits
    before it are gone, a commit after it starts the group again), and once a snapshot
    is written the group is not in it."""
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 2)
    fill(store, "T", 2, 10)
    store.commit_offset("g", "T", 0, 3)
    store.commit_offset("h", "T", 1, 5)
    store.offsets.commit_later("g", "T", 1, 4)  # pending: journaled before the deletion
    assert store.delete_group("g") == (2, store.log.end)
    assert store.get_offset("g", "T", 0) == store.get_offset("g", "T", 1) == -1
    crash(store)
    store = open_store(root)
    assert "g" not in store.offsets.groups and store.get_offset("h", "T", 1) == 5
    store.commit_offset("g", "T", 0, 2)  # a member of the group again, later
    store.offsets.save()
    assert snapshot_file(root)["groups"] == {"g": {"T": {"0": 2}}, "h": {"T": {"1": 5}}}
    assert store.delete_group("g") == (1, store.log.end)
    crash(store)
    store = open_store(root)
    assert sorted(store.offsets.groups) == ["h"] and store.offsets.replayed == 1
    store.close()


def test_first_format_snapshot_is_read(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    fill(store, "T", 1, 10)
    store.close()
    with open(os.path.join(root, "offsets.json"), "w") as f:
        json.dump({"g": {"T": {"0": 8}}}, f)
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == 8
    store.commit_offset("g", "T", 0, 9)
    crash(store)
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == 9
    store.close()


def test_commits_of_a_deleted_topic_do_not_come_back_to_its_successor(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    fill(store, "T", 1, 10)
    store.commit_offset("g", "T", 0, 8)
    store.delete_topic("T")
    store.create_topic("T", 1)
    fill(store, "T", 1, 3)
    store.commit_offset("g2", "T", 0, 2)
    crash(store)  # the journal still holds g's commit of the old topic
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == -1
    assert store.get_offset("g2", "T", 0) == 2
    store.close()


def test_committed_offset_beyond_a_cut_queue_end_moves_back_and_new_messages_arrive(tmp_path):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 1)
    for i in range(0, 1100, 100):
        store.put("T", 0, [encode_part(b"x" * 200, f"u{i + j}", 1) for j in range(100)])
    store.commit_offset("g", "T", 0, 1000)
    store.close()
    assert snapshot_file(root)["groups"]["g"]["T"]["0"] == 1000
    # the disk lost the log's tail and the checkpoint: recovery rebuilds from what is left
    os.unlink(os.path.join(root, "checkpoint"))
    segs = sorted(os.listdir(os.path.join(root, "commitlog")))
    for name in segs[len(segs) // 2:]:
        os.unlink(os.path.join(root, "commitlog", name))
    store = open_store(root)
    end = store.min_max("T", 0)[1]
    assert 0 < end < 1000
    assert store.get_offset("g", "T", 0) == end
    assert snapshot_file(root)["groups"]["g"]["T"]["0"] == end  # saved at open
    r = store.put("T", 0, [encode_part(b"new", "after-cut", 1)])
    assert r.offsets == [end]
    got = store.get("T", 0, store.get_offset("g", "T", 0), 10, 1 << 20)
    assert got.status == PullStatus.FOUND and got.count == 1  # delivered, not skipped
    store.commit_offset("g", "T", 0, end + 1)
    crash(store)
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == end + 1  # the journal goes on after the cut
    store.close()


def test_retention_keeps_segments_with_commits_no_snapshot_covers(tmp_path):
    root = str(tmp_path)
    store = open_store(root, retention_bytes=1)  # delete everything it may
    store.create_topic("T", 1)
    store.commit_offset("g", "T", 0, 0)
    for i in range(4):  # commits spread over several segments
        fill(store, "T", 1, 300, tag=str(i))
        store.commit_offset("g", "T", 0, (i + 1) * 300)
    n = len(store.log.segments)
    assert n > 3
    assert store.run_retention() == 0  # the first commit lies in the first segment
    store.offsets.save()
    assert store.run_retention() == n - 1  # covered by the snapshot now: they may go
    store.commit_offset("g", "T", 0, 1199)
    crash(store)
    store = open_store(root)
    assert store.get_offset("g", "T", 0) == 1199
    store.close()


# ---------------------------------------------------------------- a broker killed in-process
async def _kill(b: Broker) -> None:
    """Stop a broker as a killed process would: no final flush, checkpoint nor snapshot."""
    b._closing = True
    if b._server is not None:
        b._server.close()
    tasks = [*b._tasks, b.flusher._task, b.retry._task]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if b._io:
        await asyncio.wait(list(b._io))
    for conn in list(b.connections):
        conn.close()
    crash(b.store)


def _broker(root: str, files: FileOps, flush: str) -> Broker:
    store = small_store(root, flush=flush, flush_interval_ms=60_000,
                        checkpoint_interval_ms=60_000)
    return Broker(BrokerConfig(store, port=0, offsets_save_s=3600), files=files)


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_answered_commits_survive_a_killed_broker(tmp_path, flush):
    """sync: answered commits survive a kill followed by a power cut; async: a kill."""
    root = str(tmp_path / "d")
    files = PowerCutFiles()
    b = _broker(root, files, flush)
    await b.start()
    addr = f"127.0.0.1:{b.port}"
    async with Admin(addr) as admin:
        await admin.create_topic("T", 4)
    async with Producer(addr) as p:
        for q in range(4):
            await p.send_batch("T", [b"x"] * 100, queue=q)
    expect = {}
    async with PullConsumer(addr, "g") as c:
        for step in range(1, 201):
            await c.commit_offset("T", step % 4, step // 4)
            expect[step % 4] = step // 4
    await _kill(b)
    assert not os.path.exists(os.path.join(root, "offsets.json"))  # no snapshot helped
    if flush == "sync":
        files.cut_power()
    store = MessageStore(small_store(root), files=files)
    store.open()
    assert {q: store.get_offset("g", "T", q) for q in range(4)} == expect
    store.close()


def test_a_damaged_journal_record_costs_only_its_commit(tmp_path, caplog):
    root = str(tmp_path)
    store = open_store(root)
    store.create_topic("T", 3)
    fill(store, "T", 3, 20)
    for q in range(3):
        store.commit_offset("g", "T", q, 10 + q)
    store.write_checkpoint()  # the records lie before the checkpoint: checked on read
    pos = store.queues[OFFSETS_TOPIC, 0].entry(1)[0]  # the commit of queue 1
    crash(store)  # no snapshot: the journal is all there is
    seg = sorted(os.listdir(os.path.join(root, "commitlog")))[0]
    path = os.path.join(root, "commitlog", seg)
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER_SIZE + pos + 60)
        b = f.read(1)[0]
        f.seek(FILE_HEADER_SIZE + pos + 60)
        f.write(bytes([b ^ 0x5A]))
    store = open_store(root)
    assert [store.get_offset("g", "T", q) for q in range(3)] == [10, -1, 12]
    assert "offsets: journal records 1..1 are damaged" in caplog.text
    store.close()


async def test_commits_go_on_after_a_failed_fsync_stops_writes(tmp_path):
    """sync: the commit waiting for the failed fsync is not acknowledged; later commits
    are kept in memory and in the snapshot (the journal can no longer be written)."""
    root = str(tmp_path / "d")
    files = FaultFiles()
    async with running_broker(root, {"flush": "sync"}, files=files) as b:
        addr = f"127.0.0.1:{b.port}"
        async with Admin(addr) as admin:
            await admin.create_topic("T", 1)
        async with Producer(addr) as p:
            await p.send_batch("T", [b"x"] * 20, queue=0)
        async with PullConsumer(addr, "g") as c:
            await c.commit_offset("T", 0, 3)
            files.arm("fsync", 1, errno.EIO, "commitlog")
            with pytest.raises(OnceqError) as ei:
                await c.commit_offset("T", 0, 5)
            assert ei.value.code == ErrorCode.STORAGE_ERROR
            assert b.store.write_failure is not None
            await c.commit_offset("T", 0, 5)  # the consumer's retry: answered now
            await c.commit_offset("T", 0, 7)
            assert await c.fetch_offset("T", 0) == 7
    async with running_broker(root, {"flush": "sync"}) as b:  # the snapshot kept it
        assert b.store.get_offset("g", "T", 0) == 7
