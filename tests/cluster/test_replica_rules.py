"""The pure rules of replication, without etcd or sockets: the leader-epoch file, the ISR
and high watermark, and a follower store's append and cut of the leader's records."""

from __future__ import annotations

from pathlib import Path

import pytest

from onceq.broker.isr import ReplicaTracker
from onceq.log.part import encode_part
from onceq.storage.leader_epochs import (
    EpochFileError,
    LeaderEpochs,
    assign,
    decode_epochs,
    encode_epochs,
    epoch_end,
    merge_from_leader,
    truncate,
)
from onceq.storage.replica import (
    ReplicaDataError,
    ReplicaLog,
    split_records,
    topics_signature,
    whole_records,
)
from onceq.storage.store import MessageStore
from tests.helpers import small_store


# ---------------------------------------------------------------- leader epochs
def test_epoch_file_round_trip_and_checks(tmp_path: Path) -> None:
    entries = [(1, 0), (3, 4096), (4, 4096)]
    assert decode_epochs(encode_epochs(entries)) == entries
    for bad in (b"1\n0\n", b"0\n2\n1 0\n", b"0\n2\n3 0\n1 10\n", b"0\n1\nx y\n",
                b"0\n2\n1 10\n2 5\n"):
        with pytest.raises(EpochFileError):
            decode_epochs(bad)
    f = LeaderEpochs(str(tmp_path))
    assert f.load() == [] and f.last_epoch == 0
    f.set(entries)
    assert LeaderEpochs(str(tmp_path)).load() == entries


def test_epoch_end_is_the_next_epochs_start() -> None:
    entries = [(1, 0), (3, 100), (5, 250)]
    assert epoch_end(entries, 1, 400) == (1, 100)
    assert epoch_end(entries, 2, 400) == (1, 100)  # the largest epoch at or below 2
    assert epoch_end(entries, 3, 400) == (3, 250)
    assert epoch_end(entries, 5, 400) == (5, 400)  # the latest: the log end
    assert epoch_end(entries, 9, 400) == (5, 400)
    assert epoch_end(entries, 0, 400) == (-1, -1)
    assert epoch_end([], 3, 400) == (-1, -1)


def test_assign_truncate_and_merge() -> None:
    assert assign([], 1, 0) == [(1, 0)]
    assert assign([(1, 0)], 1, 50) == [(1, 0)]  # same epoch: unchanged
    assert assign([(1, 0), (2, 80)], 3, 80) == [(1, 0), (3, 80)]  # epoch 2 held nothing
    assert truncate([(1, 0), (2, 80), (3, 120)], 80) == [(1, 0), (2, 80)]
    leader = [(1, 0), (2, 80), (4, 200)]
    assert merge_from_leader([], leader, 100) == [(1, 0), (2, 80)]
    assert merge_from_leader([(1, 0)], leader, 300) == leader
    assert merge_from_leader([(1, 0)], leader, 200) == [(1, 0), (2, 80)]


# ---------------------------------------------------------------- ISR and high watermark
def test_isr_and_high_watermark() -> None:
    t = ReplicaTracker("1", lag_max_ms=1000)
    t.fetched("2", 0, 100, now_ms=0)
    t.fetched("3", 0, 100, now_ms=0)
    assert t.in_sync(0) == ["1"]  # behind the leader, never caught up
    assert t.advance(100, 0, min_insync=2) == 0  # alone in the ISR: below min_insync
    t.fetched("2", 100, 100, now_ms=10)  # caught up
    t.fetched("3", 100, 150, now_ms=20)  # has all the leader had at its last fetch
    assert t.in_sync(20) == ["1", "2", "3"]
    assert t.advance(150, 20) == 100
    t.fetched("2", 150, 150, now_ms=30)
    t.fetched("3", 150, 150, now_ms=30)
    assert t.advance(150, 30) == 150
    # "3" stops fetching: out of the ISR after lag_max; the HW follows "2"
    t.fetched("2", 150, 200, now_ms=900)
    t.fetched("2", 200, 200, now_ms=1500)
    assert t.in_sync(1500) == ["1", "2"]
    assert t.advance(200, 1500) == 200
    # with fewer in sync than min_insync the high watermark stays
    assert t.advance(300, 4000, min_insync=2) == 200
    assert t.advance(300, 4000) == 300  # acks=leader: the leader's end
    assert t.lag(300) == {"2": 100, "3": 150}


# ---------------------------------------------------------------- records
def _records(store: MessageStore, topic: str, n: int, prefix: str = "m") -> None:
    for i in range(n):
        store.put(topic, 0, [encode_part(f"{prefix}{i}".encode(), f"{prefix}-key{i}", 1)])


def test_whole_records_and_split(tmp_path: Path) -> None:
    store = MessageStore(small_store(str(tmp_path / "a")))
    store.open()
    store.create_topic("t", 1)
    _records(store, "t", 5)
    data = ReplicaLog(store).read(0, 1 << 20)
    assert len(data) == store.log.end
    heads = split_records(data, 0)
    assert [h.queue_offset for h in heads] == list(range(5))
    first = heads[0].size
    assert whole_records(data, first + 1) == first  # never a partial record
    assert whole_records(data[:first - 1], 10) == 0
    assert whole_records(data, 1) == first  # but at least one record
    damaged = bytearray(data)
    damaged[first + 40] ^= 0xFF
    with pytest.raises(ReplicaDataError, match=f"position {first}"):
        split_records(bytes(damaged), 0)
    with pytest.raises(ReplicaDataError):
        split_records(data, 8)  # records that claim other positions
    store.close()


def test_follower_appends_verbatim_and_cuts_a_tail(tmp_path: Path) -> None:
    leader = MessageStore(small_store(str(tmp_path / "l"), segment_size=64 * 1024,
                                      max_body=1024))
    follower = MessageStore(small_store(str(tmp_path / "f"), segment_size=80 * 1024,
                                        max_body=1024))
    leader.open()
    follower.open()
    leader.create_topic("t", 2)
    _records(leader, "t", 1500)  # more than one segment of either size
    src, dst = ReplicaLog(leader), ReplicaLog(follower)
    table = src.topics_table()
    dst.sync_topics(table)
    assert topics_signature(dst.topics_table()) == topics_signature(table)
    while follower.log.end < leader.log.end:
        dst.append(follower.log.end, src.read(follower.log.end, 16 * 1024))
    assert follower.log.read(0, follower.log.end) == leader.log.read(0, leader.log.end)
    r = follower.get("t", 0, 0, 2000, 1 << 24)
    assert r.count == 1500
    assert follower.dedup.get("t", b"m-key7") is not None  # fed as recovery would
    with pytest.raises(ReplicaDataError):
        dst.append(0, src.read(0, 4096))  # not at the log end
    cut = split_records(src.read(0, 1 << 20), 0)[100].position
    dst.truncate(cut)
    assert follower.log.end == cut
    assert follower.min_max("t", 0) == (0, 100)
    assert follower.dedup.get("t", b"m-key100") is None
    assert follower.dedup.get("t", b"m-key99") is not None
    while follower.log.end < leader.log.end:  # fetched again, the same bytes
        dst.append(follower.log.end, src.read(follower.log.end, 16 * 1024))
    assert follower.min_max("t", 0) == (0, 1500)
    leader.close()
    follower.close()


def test_a_shrink_holds_the_high_watermark_until_published() -> None:
    """A follower that left the ISR holds the high watermark while etcd still lists it
    (it could be elected); once the smaller ISR is published, the HW moves."""
    t = ReplicaTracker("1", lag_max_ms=1000)
    t.fetched("2", 0, 0, now_ms=0)
    t.fetched("3", 0, 0, now_ms=0)
    t.published = ("1", "2", "3")
    t.fetched("2", 100, 100, now_ms=1500)  # 3 stopped fetching at 0
    assert t.in_sync(1500) == ["1", "2"]
    assert t.to_publish(1500) == ["1", "2"]
    assert t.advance(100, 1500, min_insync=2) == 0  # 3 is still electable
    t.published = ("1", "2")
    assert t.to_publish(1500) is None
    assert t.advance(100, 1500, min_insync=2) == 100


def test_a_new_leader_seeds_its_isr_from_the_published_one() -> None:
    t = ReplicaTracker("2", lag_max_ms=1000, hw=50)
    t.seed(("1", "2", "3"), live={"2", "3"}, now_ms=0)
    assert t.in_sync(0) == ["2", "3"]  # 1 (the dead leader) is out
    assert t.to_publish(0) == ["2", "3"]
    assert t.advance(200, 10, min_insync=2) == 50  # positions unknown; 1 still listed
    t.published = ("2", "3")
    t.fetched("3", 200, 200, now_ms=20)
    assert t.advance(200, 20, min_insync=2) == 200
    assert t.in_sync(1020) == ["2", "3"] and t.in_sync(1021) == ["2"]


def test_cluster_metrics() -> None:
    pytest.importorskip("prometheus_client")
    from onceq.broker.metrics import _cluster

    st = {"role": "leader", "epoch": 4, "hw": 100, "isr": ["1", "2"], "lag": {"2": 0, "3": 70}}
    got = {m.name: m.samples for m in _cluster(st, 3)}
    assert got["onceq_leader_changes"][0].value == 3
    assert got["onceq_isr_size"][0].value == 2
    assert {s.labels["follower"]: s.value for s in got["onceq_follower_lag_bytes"]} == {
        "2": 0, "3": 70}
    follower = {m.name for m in _cluster({"role": "follower", "hw": 5}, 1)}
    assert "onceq_isr_size" not in follower and "onceq_is_leader" in follower
