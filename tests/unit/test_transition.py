"""TransitionLock: the access lock as the broker applies it (a stub store, the suite's fake
clock, an in-memory file layer; no sockets, no disk)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from onceq.broker.access_lock import decode_lock_rows
from onceq.broker.groups import BROADCASTING, CLUSTERING, GroupRegistry
from onceq.broker.transition import LOCK_FILE, TransitionLock
from onceq.storage.files import FileOps
from tests.clock import FakeClock

G, T = "g", "t"
DATA = "/data"


class MemFiles(FileOps):
    """Whole files in a dict; enough for ``write_atomic`` and ``read_file``."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self._fds: dict[int, str] = {}
        self.writes = 0

    def open(self, path, flags, mode=0o644):
        fd = len(self._fds) + 3
        self._fds[fd] = path
        self.files[path] = b""
        return fd

    def pwrite(self, fd, data, offset):
        path = self._fds[fd]
        buf = bytearray(self.files[path])
        buf[offset:offset + len(data)] = bytes(data)
        self.files[path] = bytes(buf)
        return len(data)

    def fsync(self, fd):
        pass

    def close(self, fd):
        pass

    def replace(self, src, dst):
        self.files[dst] = self.files.pop(src)
        self.writes += 1

    def fsync_dir(self, path):
        pass

    def read_file(self, path):
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None


class StubStore:
    def __init__(self) -> None:
        self.config = SimpleNamespace(data_dir=DATA)
        self.topics = {T: SimpleNamespace(queues=4), "u": SimpleNamespace(queues=2)}
        self.offsets: dict[tuple[str, str, int], int] = {}

    def get_offset(self, group, topic, queue):
        return self.offsets.get((group, topic, queue), -1)


def make(clock=None, files=None, store=None, enabled=True, restore_hold=20.0):
    clock = clock or FakeClock()
    groups = GroupRegistry(120.0, lambda *a: None)
    changes = []
    lock = TransitionLock(store or StubStore(), groups, enabled, hold_timeout=30.0,
                          stable_checks=3, clock=clock, restore_hold=restore_hold,
                          files=files or MemFiles(), on_change=lambda: changes.append(1))
    return lock, groups, clock, changes


def join(groups, client, model=CLUSTERING, lock=True, group=G):
    groups.heartbeat(group, client, object(), model, {T: "*"}, 0.0, {"access_lock": lock})


# -- who the lock applies to -----------------------------------------------------------------


def test_applies_only_to_clustering_members_with_the_lock_on():
    lock, groups, _, _ = make()
    join(groups, "a")
    join(groups, "b", model=BROADCASTING)
    join(groups, "c", lock=False)
    assert lock.applies(G, "a")
    assert not lock.applies(G, "b")
    assert not lock.applies(G, "c")
    assert not lock.applies(G, "stranger")
    assert not lock.applies(None, "a") and not lock.applies(G, None)
    off, groups2, _, _ = make(enabled=False)
    join(groups2, "a")
    assert not off.applies(G, "a")


# -- pulls -------------------------------------------------------------------------------------


def test_check_takes_free_then_refuses_others_and_counts_handovers():
    store = StubStore()
    store.offsets[(G, T, 0)] = 5
    lock, _, clock, changes = make(store=store)
    g = lock.check(G, "a", T, 0, requested=2)
    assert (g.granted, g.offset, g.holder) == (True, 5, "a")  # forward to the ack offset
    assert changes == [1]
    lock.delivered(G, T, 0, 9)
    g = lock.check(G, "b", T, 0, requested=5)
    assert (g.granted, g.offset, g.holder) == (False, 5, "a")
    assert lock.handovers == 0
    clock.advance(31)  # the holder was not seen for the hold timeout
    g = lock.check(G, "b", T, 0, requested=5)
    assert (g.granted, g.holder) == (True, "b")
    assert lock.handovers == 1 and len(changes) == 2


def test_deliver_offset_only_moves_forward_and_never_below_ack():
    lock, _, _, _ = make()
    key = (G, T, 0)
    lock.delivered(G, T, 0, 10)
    lock.delivered(G, T, 0, 7)
    assert lock.deliver[key] == 10
    assert lock.deliver_offset(key, ack=12) == 12
    assert lock.deliver_offset((G, T, 1), ack=3) == 3


def test_touch_release_and_is_holder():
    lock, _, clock, changes = make()
    lock.check(G, "a", T, 0, 0)
    clock.advance(25)
    lock.touch(group=G, client="a", topic=T, queue=0)
    clock.advance(25)  # 50 s after the take, 25 s after the touch: still held
    assert not lock.check(G, "b", T, 0, 0).granted
    assert lock.is_holder(G, "a", T, 0)
    assert not lock.release(group=G, client="b", topic=T, queue=0)
    assert lock.release(group=G, client="a", topic=T, queue=0)
    assert not lock.is_holder(G, "a", T, 0)
    assert len(changes) == 2


def test_member_gone_releases_that_group_only():
    lock, _, _, changes = make()
    lock.check(G, "a", T, 0, 0)
    lock.check("g2", "a", T, 0, 0)
    del changes[:]
    lock.member_gone(G, "a", "disconnect")
    assert lock.table.holder(G, T, 0) is None
    assert lock.table.holder("g2", T, 0) == "a"
    assert changes == [1]
    lock.member_gone(G, "a", "disconnect")  # nothing left: no change reported
    assert changes == [1]


def test_drop_topic_forgets_locks_and_deliver_offsets():
    lock, _, _, _ = make()
    lock.check(G, "a", T, 0, 0)
    lock.delivered(G, T, 0, 4)
    lock.check(G, "a", "u", 0, 0)
    lock.drop_topic(T)
    assert lock.table.holder(G, T, 0) is None and (G, T, 0) not in lock.deliver
    assert lock.table.holder(G, "u", 0) == "a"


# -- persistence across a restart ------------------------------------------------------------


def restart(files, clock, store=None, restore_hold=20.0):
    lock, groups, _, changes = make(clock=clock, files=files, store=store,
                                    restore_hold=restore_hold)
    n = lock.load()
    return lock, groups, changes, n


def test_saved_holders_and_deliver_offsets_are_restored_unconfirmed():
    files = MemFiles()
    lock, _, clock, _ = make(files=files)
    lock.check(G, "a", T, 0, 0)
    lock.delivered(G, T, 0, 40)
    lock.check(G, "b", T, 1, 0)
    lock.write_file(lock.file_data())
    assert os.path.join(DATA, LOCK_FILE) in files.files

    clock.advance(3600)  # the broker was down for an hour: the hold counts from the restart
    again, _, changes, n = restart(files, clock)
    assert n == 2 and changes == []
    assert [(r["holder"], r["unconfirmed"]) for r in again.status(G)] == [("a", True),
                                                                         ("b", True)]
    assert again.deliver[(G, T, 0)] == 40
    assert not again.check(G, "c", T, 0, 0).granted
    clock.advance(19.9)
    assert not again.check(G, "c", T, 0, 0).granted
    clock.advance(0.1)
    g = again.check(G, "c", T, 0, 0)
    assert g.granted and g.holder == "c" and again.handovers == 1


def test_reassert_after_restart_confirms_and_raises_the_deliver_offset():
    files = MemFiles()
    lock, _, clock, _ = make(files=files)
    lock.check(G, "a", T, 0, 0)
    lock.check(G, "a", T, 1, 0)
    lock.write_file(lock.file_data())
    again, _, changes, _ = restart(files, clock)
    # a holds 0 (deliver 55), no longer 1; queue 9 does not exist; topic "gone" neither
    got = again.reassert(G, "a", [(T, 0, 55), (T, 9, 1), ("gone", 0, 1)])
    assert got == [(T, 0, True)]
    assert again.deliver[(G, T, 0)] == 55
    assert [(r["queue"], r["unconfirmed"]) for r in again.status(G)] == [(0, False)]
    assert changes == [1]  # queue 1 released: the file must be written again
    assert again.check(G, "c", T, 1, 0).granted  # free at once


def test_restore_skips_deleted_topics_and_survives_a_damaged_file(caplog):
    files = MemFiles()
    store = StubStore()
    lock, _, clock, _ = make(files=files, store=store)
    lock.check(G, "a", T, 0, 0)
    lock.check(G, "a", "u", 0, 0)
    lock.write_file(lock.file_data())
    del store.topics["u"]
    again, _, _, n = restart(files, clock, store=store)
    assert n == 1 and [r["topic"] for r in again.status(G)] == [T]

    files.files[os.path.join(DATA, LOCK_FILE)] = b'{"version": 1, "locks": [1'
    again, _, _, n = restart(files, clock, store=store)
    assert n == 0 and again.status(G) == []
    assert "starting without saved access locks" in caplog.text


def test_no_file_means_no_holders():
    again, _, _, n = restart(MemFiles(), FakeClock())
    assert n == 0 and len(again.table) == 0


def test_file_data_carries_the_latest_deliver_offset():
    lock, _, _, _ = make()
    lock.check(G, "a", T, 0, 0)
    lock.delivered(G, T, 0, 77)  # a pull found messages: the table's copy is older
    (row,) = decode_lock_rows(lock.file_data())
    assert (row.holder, row.deliver_offset) == ("a", 77)


@pytest.mark.parametrize("hold", [0.0, -1.0])
def test_restore_hold_must_be_positive(hold):
    with pytest.raises(ValueError):
        make(restore_hold=hold)
