"""The queue scaler over a real store and group registry (no sockets): a topic following a
group grows and shrinks, drains before it stops reading a queue, gates moved keys, and
keeps all of it across a restart."""

from __future__ import annotations

import json
import os

import pytest

from onceq.broker.groups import CLUSTERING, GroupRegistry
from onceq.broker.queue_scaler import QueueScaler
from onceq.log.record import encode_part
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.storage.config import StoreConfig
from onceq.storage.store import MessageStore
from tests.clock import FakeClock

GRACE, SETTLE = 2.0, 1.0


class Conn:
    def __init__(self) -> None:
        self.pushed: list = []

    def push(self, msg) -> None:
        self.pushed.append(msg)


class World:
    def __init__(self, path: str, clock: FakeClock) -> None:
        self.path, self.clock = path, clock
        self.woken: list[tuple[str, int]] = []
        self.n = 0
        self.open()

    def open(self) -> None:
        self.store = MessageStore(StoreConfig(self.path, segment_size=64 * 1024,
                                              index_entries_per_file=64, max_body=4096),
                                  clock=self.clock)
        self.store.open()
        self.groups = GroupRegistry(60, lambda g, c, r: self.scaler.on_members(g))
        self.scaler = QueueScaler(self.store, self.groups, self.clock, grace_s=GRACE,
                                  settle_s=SETTLE, start_hold_s=0,
                                  wake=lambda t, q: self.woken.append((t, q)))
        self.conn = Conn()

    def members(self, n: int) -> None:
        have = [m.client_id for m in self.groups.members("g")]
        for i in range(len(have), n):
            self.groups.heartbeat("g", f"c{i}", self.conn, CLUSTERING, {"T": "*"},
                                  self.clock())
        for cid in have[n:]:
            self.groups.unregister("g", cid)

    def put(self, queue: int, count: int = 3) -> None:
        self.scaler.check_write("T", queue)
        parts = []
        for _ in range(count):
            self.n += 1
            parts.append(encode_part(b"x", f"UK{self.n:08d}", 1000))
        self.store.put("T", queue, parts)

    def consume_all(self, group: str = "g") -> None:
        t = self.store.get_topic("T")
        for q in range(t.readable):
            self.store.commit_offset(group, "T", q, self.store.min_max("T", q)[1])

    def settle(self, seconds: float = SETTLE) -> None:
        self.clock.advance(seconds)
        self.scaler.tick()

    def layout(self) -> tuple[int, int, int]:
        t = self.store.get_topic("T")
        return t.readable, t.writable, t.queues


@pytest.fixture
def world(tmp_path):
    w = World(str(tmp_path / "data"), FakeClock(1_700_000_000.0))
    w.store.create_topic("T", 1)
    yield w
    w.store.close()


def test_grow_then_shrink_after_drain(world):
    w = world
    w.scaler.follow("T", "g", 1, 8)
    assert w.layout() == (1, 1, 1)
    w.put(0)
    w.members(3)
    w.scaler.tick()
    assert w.layout() == (1, 1, 1)  # the size has not settled yet
    w.settle()
    assert w.layout() == (4, 4, 4)  # writes and reads grow at once
    s = w.scaler.status("T")
    assert s["grace_left_s"] == pytest.approx(GRACE)
    # queues 1..3 take keys that were on queue 0: read up to their start (0) until queue
    # 0 is consumed to its end after the grace
    assert {g["queue"] for g in s["gates"]} == {1, 2, 3}
    assert w.scaler.read_limit(None)("T", 1) == 0
    assert w.scaler.read_limit(None)("T", 0) is None
    w.put(3)  # a producer with the new count
    w.put(0)  # one still with the old count, during the grace
    w.settle(GRACE)
    assert w.scaler.read_limit(None)("T", 3) == 0  # queue 0 not consumed yet
    w.store.commit_offset("g", "T", 0, 6)
    w.scaler.tick()
    assert w.scaler.read_limit(None)("T", 3) is None
    assert sorted(w.woken) == [("T", 1), ("T", 2), ("T", 3)]
    assert w.scaler.status("T")["gates"] == []

    w.members(1)
    w.settle()
    assert w.layout() == (4, 1, 4)  # writes shrink at once; reads stay while draining
    w.put(2)  # allowed during the grace (old count)
    w.settle(GRACE)
    with pytest.raises(OnceqError) as exc:
        w.put(2)
    assert exc.value.code == ErrorCode.INVALID_QUEUE
    s = w.scaler.status("T")
    assert [d["queue"] for d in s["draining"]] == [1, 2, 3]
    assert s["draining"][1]["waiting"] == ["g"]
    assert w.layout() == (4, 1, 4)
    # queue 0 from its end at the shrink waits for queues 1..3
    assert w.scaler.read_limit(None)("T", 0) == 6
    w.store.commit_offset("g", "T", 1, 0)  # queue 1 was empty: drained
    w.scaler.tick()
    assert w.layout() == (4, 1, 4)  # queue 1 is drained but 2 and 3 are above it
    w.store.commit_offset("g", "T", 3, 3)
    w.scaler.tick()
    assert w.layout() == (3, 1, 4)  # the top queue drained: it leaves reading
    w.consume_all()
    w.scaler.tick()
    assert w.layout() == (1, 1, 4)
    assert w.scaler.read_limit(None)("T", 0) is None
    assert w.conn.pushed  # the members were told to rebalance


def test_a_group_with_offsets_only_holds_the_drain(world):
    w = world
    w.members(2)
    w.scaler.follow("T", "g", 1, 8)
    assert w.layout() == (2, 2, 2)
    w.put(1)
    w.store.commit_offset("other", "T", 1, 1)  # a group with no live member
    w.members(1)
    w.settle(GRACE)  # the growth's grace ends, the shrink starts
    w.settle(GRACE)
    w.consume_all("g")
    w.scaler.tick()
    assert w.layout() == (2, 1, 2)
    assert w.scaler.status("T")["draining"][0]["waiting"] == ["other"]
    w.store.commit_offset("other", "T", 1, 3)
    w.scaler.tick()
    assert w.layout() == (1, 1, 2)


def test_a_deleted_group_holds_nothing(world):
    """A group that will not come back (no member, offsets behind) holds the drain until
    its offsets are forgotten (``onceq group delete``)."""
    w = world
    w.members(2)
    w.scaler.follow("T", "g", 1, 8)
    w.put(1)
    w.store.commit_offset("gone", "T", 1, 1)
    w.members(1)
    w.settle(GRACE)
    w.settle(GRACE)
    w.consume_all("g")
    w.scaler.tick()
    assert w.scaler.status("T")["draining"][0]["waiting"] == ["gone"]
    assert w.store.delete_group("gone")[0] == 1
    w.scaler.tick()
    assert w.layout() == (1, 1, 2)


def test_no_change_while_one_is_in_flight(world):
    w = world
    w.scaler.follow("T", "g", 1, 16)
    w.members(2)
    w.settle()
    assert w.layout() == (2, 2, 2)
    w.members(8)
    w.settle()
    assert w.layout() == (2, 2, 2)  # the grace of the first change runs
    w.settle(GRACE)
    assert w.layout() == (8, 8, 8)


def test_without_key_order_no_gate(world):
    w = world
    w.scaler.follow("T", "g", 1, 8, key_order=False)
    w.members(4)
    w.settle()
    assert w.layout() == (4, 4, 4)
    assert w.scaler.status("T")["gates"] == []
    assert w.scaler.read_limit(None)("T", 2) is None


def test_frozen_counts(world):
    w = world
    w.scaler.follow("T", "g", 1, 8)
    w.members(4)
    w.settle()
    w.scaler.follow("T", None, 1, 8)
    w.members(1)
    w.settle()
    w.settle(GRACE)
    assert w.layout() == (4, 4, 4)


def test_state_survives_a_restart_and_old_entries_load(world):
    w = world
    w.store.create_topic("Plain", 2)
    w.scaler.follow("T", "g", 1, 8)
    w.members(4)
    w.settle()
    w.members(1)
    w.settle(GRACE)
    w.settle()
    assert w.layout() == (4, 1, 4)
    before = w.scaler.status("T")
    w.store.close()
    with open(os.path.join(w.path, "topics.json")) as f:
        table = json.load(f)
    assert set(table["Plain"]) == {"queues", "created_position", "created_ms"}
    assert table["T"]["read_queues"] == 4 and table["T"]["write_queues"] == 1
    w.open()
    assert w.layout() == (4, 1, 4)
    assert w.scaler.status("T")["draining"] == before["draining"]
    assert w.store.get_topic("Plain").readable == 2
    w.settle(GRACE)
    w.consume_all()
    w.scaler.tick()
    assert w.layout() == (1, 1, 4)


def test_bad_bounds_refused(world):
    with pytest.raises(OnceqError):
        world.scaler.follow("T", "g", 4, 2)
