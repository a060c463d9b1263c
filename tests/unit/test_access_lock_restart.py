"""Access lock across a broker restart: saved holders, the unconfirmed-holder rule,
re-assertion by heartbeat, and ``release_client_group`` (pure; times are plain floats)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.broker.access_lock import (
    AccessLockTable,
    LockRow,
    decode_lock_rows,
    encode_lock_rows,
)

G, T = "group", "topic"
START = 1000.0  # broker start time of the restored table


def pull(table, client, queue_id=0, requested=0, ack=-1, deliver=-1, now=START, group=G):
    return table.on_pull(group, T, queue_id, client, requested, ack, deliver, now)


def restored(rows, restore_hold=20.0, **kw):
    table = AccessLockTable(restore_hold=restore_hold, **kw)
    table.restore(rows, START)
    return table


# -- file format ---------------------------------------------------------------------------


rows_st = st.lists(
    st.builds(LockRow, st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8),
              st.integers(0, 1023), st.text(min_size=1, max_size=20),
              st.integers(-1, 2**62)),
    max_size=20)


@settings(max_examples=100)
@given(rows_st)
def test_lock_file_round_trip(rows):
    assert decode_lock_rows(encode_lock_rows(rows)) == rows


@pytest.mark.parametrize("raw", [
    b"", b"{", b"\xff\xfe", b"[]", b'{"version": 2, "locks": []}', b'{"version": 1}',
    b'{"version": 1, "locks": [["g", "t", 0, "c"]]}',
    b'{"version": 1, "locks": [["g", "t", "0", "c", 5]]}',
    b'{"version": 1, "locks": [["g", "t", 0, "c", true]]}',
])
def test_damaged_lock_file_is_rejected(raw):
    with pytest.raises(ValueError):
        decode_lock_rows(raw)


def test_export_restore_round_trip():
    table = AccessLockTable()
    pull(table, "a", queue_id=0, deliver=7)
    pull(table, "b", queue_id=1, deliver=3)
    pull(table, "a", queue_id=2, deliver=-1, group="g2")
    rows = table.export()
    assert rows == [LockRow("g2", T, 2, "a", -1), LockRow(G, T, 0, "a", 7),
                    LockRow(G, T, 1, "b", 3)]
    again = restored(decode_lock_rows(encode_lock_rows(rows)))
    assert again.export() == rows
    assert [r["unconfirmed"] for r in again.snapshot(G)] == [True, True]
    # the client index is rebuilt too: releasing a client finds its restored locks
    assert again.release_client("a") == [("g2", T, 2), (G, T, 0)]


def test_restore_replaces_the_table_and_keeps_one_holder_per_queue():
    table = AccessLockTable()
    pull(table, "x", queue_id=5)
    table.restore([LockRow(G, T, 0, "a", 1), LockRow(G, T, 0, "b", 2)], START)
    assert table.export() == [LockRow(G, T, 0, "b", 2)]
    assert table.release_client("a") == []
    assert table.release_client("b") == [(G, T, 0)]


# -- the unconfirmed-holder rule -------------------------------------------------------------


def test_unconfirmed_holder_keeps_its_queue_until_the_restore_hold_passes():
    table = restored([LockRow(G, T, 0, "a", 10)], restore_hold=20.0, stable_checks=1,
                     hold_timeout=16.0)
    # drained (deliver == ack) and stable: a confirmed holder would lose the queue here, and
    # the ordinary hold timeout passes too; an unconfirmed one does not
    for now in (START, START + 1, START + 16.5, START + 19.999):
        d = pull(table, "b", requested=4, ack=10, deliver=10, now=now)
        assert not d.granted and d.holder == "a" and d.offset == 4
    d = pull(table, "b", requested=4, ack=10, deliver=10, now=START + 20.0)
    assert d.granted and d.takeover == "unconfirmed-timeout" and d.previous_holder == "a"
    assert d.offset == 10  # corrected forward to the ack offset
    assert table.snapshot(G)[0]["unconfirmed"] is False


def test_unconfirmed_holders_are_the_restored_ones_not_back_yet():
    table = restored([LockRow(G, T, 0, "a", 1), LockRow(G, T, 1, "b", 1),
                      LockRow(G, T, 2, "b", 1), LockRow("g2", T, 0, "c", 1)])
    assert table.unconfirmed_holders(G, START) == ["a", "b"]
    table.reassert(G, "a", {(T, 0): 1}, now=START + 1)
    assert table.unconfirmed_holders(G, START + 1) == ["b"]
    pull(table, "b", queue_id=1, now=START + 2)  # one confirmed, one not yet: still listed
    assert table.unconfirmed_holders(G, START + 2) == ["b"]
    assert table.unconfirmed_holders(G, START + 20) == []  # the restore hold has passed
    assert table.unconfirmed_holders("g2", START) == ["c"]


def test_restore_hold_counts_from_the_restore_not_from_the_saved_access():
    table = AccessLockTable(restore_hold=5.0)
    table.restore([LockRow(G, T, 0, "a", 0)], now=50.0)
    assert not pull(table, "b", now=54.9).granted
    assert pull(table, "b", now=55.0).granted


def test_restored_holder_that_pulls_is_confirmed_and_then_ordinary_rules_apply():
    table = restored([LockRow(G, T, 0, "a", 10)], stable_checks=2)
    assert pull(table, "a", requested=10, ack=8, deliver=10, now=START + 1).offset == 10
    assert table.snapshot(G)[0]["unconfirmed"] is False
    assert not pull(table, "b", ack=10, deliver=10, now=START + 2).granted  # check 1
    assert pull(table, "b", ack=10, deliver=10, now=START + 3).takeover == "drained"


# -- re-assertion on heartbeat ---------------------------------------------------------------


def test_reassert_confirms_own_takes_free_and_leaves_others():
    table = restored([LockRow(G, T, 0, "a", 10), LockRow(G, T, 1, "b", 3)])
    changes = table.changes
    got = table.reassert(G, "a", {(T, 0): 12, (T, 1): 5, (T, 2): 7}, now=START + 1)
    assert got == {(T, 0): True, (T, 1): False, (T, 2): True}
    rows = {r["queue_id"]: r for r in table.snapshot(G)}
    assert rows[0]["holder"] == "a" and not rows[0]["unconfirmed"]
    assert rows[0]["last_deliver_offset"] == 12 and rows[0]["last_access"] == START + 1
    assert rows[1]["holder"] == "b" and rows[1]["unconfirmed"]
    assert rows[2]["holder"] == "a" and rows[2]["last_deliver_offset"] == 7
    assert table.changes == changes + 1  # only the free take changed a holder


def test_queue_taken_back_by_heartbeat_after_a_restart_corrects_the_first_pull_forward():
    # the broker restarted without its lock file; b held the queue and had looked its
    # start offset (2) up before a's final commit (6); b's heartbeat lists the queue
    table = restored([])
    assert table.reassert(G, "b", {(T, 0): 2}, now=START) == {(T, 0): True}
    d = pull(table, "b", requested=2, ack=6, deliver=6)
    assert d.granted and d.offset == 6
    assert pull(table, "b", requested=3, ack=6, deliver=6).offset == 3  # only the first


def test_a_heartbeat_never_takes_a_free_queue_outside_the_restart_protocol():
    # the member was away (paused) past its lock: the broker freed the queue, or another
    # member held it meanwhile; listing it in a heartbeat does not make it the holder again
    never_restored = AccessLockTable()
    assert never_restored.reassert(G, "a", {(T, 0): 2}, now=START) == {(T, 0): False}
    assert never_restored.holder(G, T, 0) is None

    table = restored([LockRow(G, T, 0, "a", 10)])
    pull(table, "b", queue_id=1, now=START)  # held since the start ...
    table.release(group=G, topic=T, queue_id=1, client_id="b")  # ... and freed
    assert table.release_client("a") == [(G, T, 0)]  # a's heartbeat expired
    got = table.reassert(G, "a", {(T, 0): 10, (T, 1): 3}, now=START + 1)
    assert got == {(T, 0): False, (T, 1): False}
    late = restored([])  # a free queue nobody touched, but after the restore hold
    hold = late.restore_hold
    assert late.reassert(G, "a", {(T, 2): 1}, now=START + hold) == {(T, 2): False}
    assert len(table) == len(late) == 0
    assert pull(table, "a", queue_id=0, requested=10, ack=40).offset == 40  # at the group's


def test_reassert_never_moves_the_deliver_offset_back():
    table = restored([LockRow(G, T, 0, "a", 10)])
    table.reassert(G, "a", {(T, 0): 4}, now=START)
    assert table.export() == [LockRow(G, T, 0, "a", 10)]


def test_reassert_releases_unconfirmed_locks_the_client_no_longer_holds():
    table = restored([LockRow(G, T, 0, "a", 1), LockRow(G, T, 1, "a", 1),
                      LockRow("g2", T, 0, "a", 1)])
    pull(table, "a", queue_id=3)  # confirmed: taken after the restart
    assert table.reassert(G, "a", {(T, 1): 1}, now=START) == {(T, 1): True}
    assert [(r.group, r.queue_id) for r in table.export()] == [("g2", 0), (G, 1), (G, 3)]
    # the released queue is free at once, no waiting for the restore hold
    assert pull(table, "b", queue_id=0, requested=0, ack=1).takeover == "free"


def test_reassert_keeps_confirmed_locks_it_does_not_list():
    # a heartbeat that raced a take (or an old client without the field) must not drop a
    # lock the broker saw the client take after the restart
    table = AccessLockTable()
    pull(table, "a", queue_id=0)
    assert table.reassert(G, "a", {}, now=START) == {}
    assert table.holder(G, T, 0) == "a"


# -- release_client_group --------------------------------------------------------------------


def test_release_client_group_removes_only_that_group():
    table = AccessLockTable()
    pull(table, "a", queue_id=0)
    pull(table, "a", queue_id=1)
    pull(table, "a", queue_id=0, group="g2")
    pull(table, "b", queue_id=2)
    changes = table.changes
    assert table.release_client_group("a", G) == [(G, T, 0), (G, T, 1)]
    assert table.changes == changes + 1
    assert table.holder(G, T, 0) is None and table.holder(G, T, 1) is None
    assert table.holder("g2", T, 0) == "a"
    assert table.holder(G, T, 2) == "b"
    # the client's index still knows the other group's lock
    assert table.release_client("a") == [("g2", T, 0)]


def test_release_client_group_of_unknown_client_or_group_changes_nothing():
    table = AccessLockTable()
    pull(table, "a", queue_id=0)
    changes = table.changes
    assert table.release_client_group("nobody", G) == []
    assert table.release_client_group("a", "other") == []
    assert table.changes == changes
    assert table.holder(G, T, 0) == "a"


def test_release_client_group_frees_queues_for_the_next_caller():
    table = AccessLockTable()
    pull(table, "a", queue_id=0, deliver=9)
    table.release_client_group("a", G)
    d = pull(table, "b", queue_id=0, requested=2, ack=6, deliver=9)
    assert d.takeover == "free" and d.offset == 6


def test_release_client_group_drops_unconfirmed_restored_locks():
    table = restored([LockRow(G, T, 0, "a", 5)])
    assert table.release_client_group("a", G) == [(G, T, 0)]
    assert pull(table, "b", ack=5).takeover == "free"


def test_invalid_restore_hold():
    with pytest.raises(ValueError):
        AccessLockTable(restore_hold=0)
