"""OwnershipService: the queue-ownership core as the broker applies it (a stub store, the
suite's fake clock, an in-memory file layer; no sockets, no disk)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from onceq.broker.access_lock import LockRow, encode_lock_rows
from onceq.broker.groups import BROADCASTING, CLUSTERING, GroupRegistry
from onceq.broker.offset_reset import ResetFence
from onceq.broker.ownership import QueueOwnership
from onceq.broker.ownership_service import FILE, LEGACY_FILES, OwnershipService
from onceq.broker.queue_lock_table import encode_lock_file
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

    def unlink(self, path):
        try:
            del self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None


class StubStore:
    def __init__(self) -> None:
        self.config = SimpleNamespace(data_dir=DATA)
        self.topics = {T: SimpleNamespace(queues=4), "u": SimpleNamespace(queues=2)}
        self.offsets: dict[tuple[str, str, int], int] = {}

    def get_offset(self, group, topic, queue):
        return self.offsets.get((group, topic, queue), -1)

    def min_max(self, topic, queue):
        return 0, 100


def make(clock=None, files=None, store=None, enabled=True, restore_hold=20.0):
    clock = clock or FakeClock()
    groups = GroupRegistry(120.0, lambda *a: None)
    changes = []
    config = SimpleNamespace(access_lock=enabled, access_lock_hold_s=30.0,
                             access_lock_stable_checks=3, access_lock_restore_hold_s=restore_hold,
                             queue_lock_expiry_s=60.0)
    svc = OwnershipService(config, store or StubStore(), groups, clock, durable=None,
                           files=files or MemFiles(), on_change=lambda: changes.append(1))
    return svc, groups, clock, changes


def pull(svc, client, queue, offset, topic=T, group=G):
    """A pull under the access lock: (granted, offset to read, holder after)."""
    d = svc.pull(group, client, topic, queue, offset)
    return d.refused is None, d.offset, svc.holder(group, topic, queue)


def join(groups, client, model=CLUSTERING, lock=True, group=G):
    groups.heartbeat(group, client, object(), model, {T: "*"}, 0.0, {"access_lock": lock})


# -- who the lock applies to -----------------------------------------------------------------


def test_applies_only_to_clustering_members_with_the_lock_on():
    svc, groups, _, _ = make()
    join(groups, "a")
    join(groups, "b", model=BROADCASTING)
    join(groups, "c", lock=False)
    assert svc.applies(G, "a")
    assert not svc.applies(G, "b")
    assert not svc.applies(G, "c")
    assert not svc.applies(G, "stranger")
    assert not svc.applies(None, "a") and not svc.applies(G, None)
    off, groups2, _, _ = make(enabled=False)
    join(groups2, "a")
    assert not off.applies(G, "a")


# -- pulls -------------------------------------------------------------------------------------


def test_a_pull_takes_a_free_queue_then_refuses_others_and_counts_handovers():
    store = StubStore()
    store.offsets[(G, T, 0)] = 5
    svc, groups, clock, changes = make(store=store)
    join(groups, "a")
    join(groups, "b")
    assert pull(svc, "a", 0, 2) == (True, 5, "a")  # forward to the ack offset
    assert changes == [1]
    svc.delivered(G, T, 0, 9)
    assert pull(svc, "b", 0, 5) == (False, 5, "a")
    assert svc.handovers == 0
    clock.advance(31)  # the holder was not seen for the hold timeout
    assert pull(svc, "b", 0, 5)[::2] == (True, "b")
    assert svc.handovers == 1 and len(changes) == 2


def test_deliver_offset_only_moves_forward_and_never_below_ack():
    svc, _, _, _ = make()
    key = (G, T, 0)
    svc.delivered(G, T, 0, 10)
    svc.delivered(G, T, 0, 7)
    assert svc.core.deliver[key] == 10
    assert svc.core.deliver_offset(key, ack=12) == 12
    assert svc.core.deliver_offset((G, T, 1), ack=3) == 3


def test_touch_release_and_holder():
    svc, groups, clock, changes = make()
    join(groups, "a")
    join(groups, "b")
    pull(svc, "a", 0, 0)
    clock.advance(25)
    svc.touch(G, "a", T, 0)
    clock.advance(25)  # 50 s after the take, 25 s after the touch: still held
    assert not pull(svc, "b", 0, 0)[0]
    assert svc.holder(G, T, 0) == "a"
    assert svc.release(G, "b", T, 0, None) == (False, 0)
    assert svc.release(G, "a", T, 0, None) == (True, 0)
    assert svc.holder(G, T, 0) is None
    assert len(changes) == 2


def test_member_gone_releases_that_group_only():
    svc, groups, _, changes = make()
    join(groups, "a")
    join(groups, "a", group="g2")
    pull(svc, "a", 0, 0)
    pull(svc, "a", 0, 0, group="g2")
    del changes[:]
    svc.member_gone(G, "a", "disconnect")
    assert svc.holder(G, T, 0) is None
    assert svc.holder("g2", T, 0) == "a"
    assert changes == [1]
    svc.member_gone(G, "a", "disconnect")  # nothing left: no change reported
    assert changes == [1]


def test_drop_topic_forgets_locks_and_deliver_offsets():
    svc, groups, _, _ = make()
    join(groups, "a")
    pull(svc, "a", 0, 0)
    svc.delivered(G, T, 0, 4)
    pull(svc, "a", 0, 0, topic="u")
    svc.drop_topic(T)
    assert svc.holder(G, T, 0) is None and (G, T, 0) not in svc.core.deliver
    assert svc.holder(G, "u", 0) == "a"


# -- persistence across a restart ------------------------------------------------------------


def restart(files, clock, store=None, restore_hold=20.0):
    svc, groups, _, changes = make(clock=clock, files=files, store=store,
                                   restore_hold=restore_hold)
    n = svc.load()
    return svc, groups, changes, n


def test_saved_holders_and_deliver_offsets_are_restored_unconfirmed():
    files = MemFiles()
    svc, groups, clock, _ = make(files=files)
    join(groups, "a")
    join(groups, "b")
    pull(svc, "a", 0, 0)
    svc.delivered(G, T, 0, 40)
    pull(svc, "b", 1, 0)
    svc.write_file(svc.file_data())
    assert os.path.join(DATA, FILE) in files.files

    clock.advance(3600)  # the broker was down for an hour: the hold counts from the restart
    again, groups, changes, n = restart(files, clock)
    assert n == 2 and changes == []
    assert [(r["holder"], r["unconfirmed"]) for r in again.status(G)] == [("a", True),
                                                                         ("b", True)]
    assert again.core.deliver[(G, T, 0)] == 40
    join(groups, "c")
    assert not pull(again, "c", 0, 0)[0]
    clock.advance(19.9)
    assert not pull(again, "c", 0, 0)[0]
    clock.advance(0.1)
    assert pull(again, "c", 0, 0)[::2] == (True, "c") and again.handovers == 1


def test_reassert_after_restart_confirms_and_raises_the_deliver_offset():
    files = MemFiles()
    svc, groups, clock, _ = make(files=files)
    join(groups, "a")
    pull(svc, "a", 0, 0)
    pull(svc, "a", 1, 0)
    svc.write_file(svc.file_data())
    again, groups, changes, _ = restart(files, clock)
    join(groups, "a")
    join(groups, "c")
    # a holds 0 (deliver 55), no longer 1; queue 9 does not exist; topic "gone" neither
    locked, got, pending = again.heartbeat(G, "a", [(T, 0, 55), (T, 9, 1), ("gone", 0, 1)],
                                           None)
    assert locked and got == [(T, 0, True)] and pending is None
    assert again.core.deliver[(G, T, 0)] == 55
    assert [(r["queue"], r["unconfirmed"]) for r in again.status(G)] == [(0, False)]
    assert changes == [1]  # queue 1 released: the file must be written again
    assert pull(again, "c", 1, 0)[0]  # free at once


def test_one_file_holds_access_locks_orderly_locks_and_fences():
    files = MemFiles()
    svc, groups, clock, _ = make(files=files)
    join(groups, "a")
    join(groups, "o", lock=False)
    pull(svc, "a", 0, 0)
    assert svc.core.lock(G, "o", [(T, 2)], clock()) == {(T, 2)}
    gen = svc.reset(G, ["z"], {(T, 3)})
    svc.write_file(svc.file_data())
    assert list(files.files) == [os.path.join(DATA, FILE)]
    again, _, _, n = restart(files, clock)
    assert n == 1 and again.holder(G, T, 0) == "a"
    assert [r["holder"] for r in again.orderly_status(G)] == ["o"]
    assert again.core.fences.pending(G, "z") == {"group": G, "gen": gen,
                                                 "queues": [[T, 3]]}


def test_the_files_of_earlier_versions_are_read_once_then_replaced():
    files = MemFiles()
    fences = ResetFence()
    gen = fences.add(G, ["z"], {(T, 1)}, 5.0)
    legacy = [encode_lock_rows([LockRow(G, T, 0, "a", 7)]),
              encode_lock_file([(G, T, 2, "o")]), fences.encode()]
    for name, data in zip(LEGACY_FILES, legacy, strict=True):
        files.files[os.path.join(DATA, name)] = data
    again, _, _, n = restart(files, FakeClock())
    assert n == 1 and again.holder(G, T, 0) == "a" and again.core.deliver[(G, T, 0)] == 7
    assert [r["holder"] for r in again.orderly_status(G)] == ["o"]
    assert again.core.fences.pending(G, "z")["gen"] == gen
    again.write_file(again.file_data())
    assert list(files.files) == [os.path.join(DATA, FILE)]


def test_restore_skips_deleted_topics_and_survives_a_damaged_file(caplog):
    files = MemFiles()
    store = StubStore()
    svc, groups, clock, _ = make(files=files, store=store)
    join(groups, "a")
    pull(svc, "a", 0, 0)
    pull(svc, "a", 0, 0, topic="u")
    svc.write_file(svc.file_data())
    del store.topics["u"]
    again, _, _, n = restart(files, clock, store=store)
    assert n == 1 and [r["topic"] for r in again.status(G)] == [T]

    files.files[os.path.join(DATA, FILE)] = b'{"version": 1, "access": [1'
    again, _, _, n = restart(files, clock, store=store)
    assert n == 0 and again.status(G) == []
    assert "starting without saved locks and fences" in caplog.text


def test_no_file_means_no_holders():
    again, _, _, n = restart(MemFiles(), FakeClock())
    assert n == 0 and len(again.core.access) == 0


def test_file_data_carries_the_latest_deliver_offset():
    svc, groups, _, _ = make()
    join(groups, "a")
    pull(svc, "a", 0, 0)
    svc.delivered(G, T, 0, 77)  # a pull found messages: the table's copy is older
    (row,) = json.loads(svc.file_data())["access"]
    assert (row[3], row[4]) == ("a", 77)


@pytest.mark.parametrize("hold", [0.0, -1.0])
def test_restore_hold_must_be_positive(hold):
    with pytest.raises(ValueError):
        QueueOwnership(restore_hold=hold)


def test_expiry_forgets_expired_orderly_locks_and_fences_of_clients_gone_for_good():
    svc, _groups, clock, changes = make()
    assert svc.core.lock(G, "o", [(T, 0)], clock()) == {(T, 0)}
    svc.reset(G, ["gone"], {(T, 1)})
    clock.advance(61)  # the lock expired: free, but still in the table
    del changes[:]
    svc.expire()
    assert changes == [1] and len(svc.core.fences) == 1  # the lock is forgotten
    clock.advance(3600)  # the fenced client never came back
    del changes[:]
    svc.expire()
    assert len(svc.core.fences) == 0 and changes == [1]
