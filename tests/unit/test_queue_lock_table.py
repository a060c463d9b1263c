"""Orderly queue locks (the pure table), with the suite's fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.queue_lock_table import QueueLockTable, decode_lock_file, encode_lock_file
from tests.clock import FakeClock

G = "g"
Q = [("T", i) for i in range(4)]


def test_batch_lock_returns_the_queues_now_held():
    clock = FakeClock()
    t = QueueLockTable(60.0)
    assert t.lock(G, "a", Q[:3], clock()) == set(Q[:3])
    # b asks for all four: only the free one is granted
    assert t.lock(G, "b", Q, clock()) == {Q[3]}
    assert [t.holder(G, *q, clock()) for q in Q] == ["a", "a", "a", "b"]
    # relocking is a renewal: a keeps its queues, gets nothing of b's
    assert t.lock(G, "a", Q, clock()) == set(Q[:3])
    # another group is another table
    assert t.lock("other", "b", Q, clock()) == set(Q)


def test_lock_expires_after_60s_without_renewal_and_renewal_keeps_it():
    clock = FakeClock()
    t = QueueLockTable(60.0)
    t.lock(G, "a", Q[:2], clock())
    clock.advance(40)
    assert t.lock(G, "a", Q[:1], clock()) == {Q[0]}  # renews Q0 only
    clock.advance(20.5)  # Q1: 60.5 s since its lock; Q0: 20.5 s since its renewal
    assert t.holder(G, *Q[1], clock()) is None
    assert t.holder(G, *Q[0], clock()) == "a"
    assert t.lock(G, "b", Q[:2], clock()) == {Q[1]}
    assert t.lock(G, "a", Q[:1], clock()) == {Q[0]}
    clock.advance(60.0)  # exactly the expiry since the renewal: still held
    assert t.holder(G, *Q[0], clock()) == "a"
    clock.advance(0.001)
    assert t.holder(G, *Q[0], clock()) is None
    assert t.expire(clock()) == [(G, "T", 0, "a"), (G, "T", 1, "b")]
    assert t.snapshot(G, clock()) == []


def test_unlock_by_the_holder_only():
    clock = FakeClock()
    t = QueueLockTable()
    t.lock(G, "a", Q[:2], clock())
    assert t.unlock(G, "b", Q[:2], clock()) == set()
    assert t.holder(G, *Q[0], clock()) == "a"
    assert t.unlock(G, "a", [Q[0], Q[3]], clock()) == {Q[0]}  # Q3: not held, ignored
    assert t.holder(G, *Q[0], clock()) is None
    assert t.holder(G, *Q[1], clock()) == "a"
    # an expired lock cannot be unlocked (nor its offset committed) by its old holder
    clock.advance(61)
    assert t.unlock(G, "a", [Q[1]], clock()) == set()


def test_unlock_commits_first_then_releases():
    clock = FakeClock()
    t = QueueLockTable()
    t.lock(G, "a", Q[:2], clock())
    seen = []

    def commit(q):  # runs while a still holds q: nobody can take it before the commit
        seen.append((q, t.holder(G, *q, clock())))

    assert t.unlock(G, "a", Q, clock(), commit) == set(Q[:2])
    assert seen == [(Q[0], "a"), (Q[1], "a")]  # queues a does not hold: no commit
    calls = []
    t.lock(G, "a", Q[:1], clock())
    t.unlock(G, "b", Q[:1], clock(), calls.append)
    assert calls == []  # not the holder: no commit


def test_a_failed_commit_keeps_the_lock():
    clock = FakeClock()
    t = QueueLockTable()
    t.lock(G, "a", Q[:1], clock())

    def fail(q):
        raise OSError("disk full")

    with pytest.raises(OSError):
        t.unlock(G, "a", Q[:1], clock(), fail)
    assert t.holder(G, *Q[0], clock()) == "a"


def test_release_on_disconnect_frees_the_queues_at_once():
    clock = FakeClock()
    t = QueueLockTable()
    t.lock(G, "a", Q[:2], clock())
    t.lock("h", "a", Q[:1], clock())
    t.lock(G, "b", Q[2:], clock())
    assert sorted(t.release_client("a", G)) == [(G, "T", 0), (G, "T", 1)]
    assert t.holder("h", *Q[0], clock()) == "a"  # only that group
    assert t.lock(G, "b", Q, clock()) == set(Q)  # no wait for the expiry
    assert t.release_client("a") == [("h", "T", 0)]


def test_queue_held_by_the_other_lock_kind_is_not_granted():
    clock = FakeClock()
    t = QueueLockTable()
    access = {Q[0]: "c"}  # a concurrent member holds Q0's access lock

    def taken(topic, queue):
        return access.get((topic, queue))

    assert t.lock(G, "a", Q[:2], clock(), taken) == {Q[1]}
    access[Q[1]] = "a"  # its own access lock does not stand in its way
    assert t.lock(G, "a", Q[:2], clock(), taken) == {Q[1]}
    del access[Q[0]]
    assert t.lock(G, "a", Q[:2], clock(), taken) == set(Q[:2])


def test_snapshot_shows_holder_and_age():
    clock = FakeClock()
    t = QueueLockTable()
    t.lock(G, "a", Q[:1], clock())
    clock.advance(25)
    t.lock(G, "a", Q[:1], clock())
    clock.advance(5)
    assert t.snapshot(G, clock()) == [{"topic": "T", "queue": 0, "holder": "a",
                                       "age_s": 30.0, "renewed_s": 5.0}]
    t.drop_topic("T")
    assert t.snapshot(G, clock()) == []


@given(st.lists(st.tuples(st.sampled_from(["lock", "unlock", "gone", "wait"]),
                          st.sampled_from("abc"), st.sets(st.integers(0, 3)),
                          st.floats(0, 40)), max_size=40))
def test_never_two_holders_and_a_grant_is_exactly_the_free_or_own(ops):
    """Against a model: a queue is granted iff free (never locked, unlocked, gone or not
    renewed for 60 s) or the caller's own."""
    clock = FakeClock()
    t = QueueLockTable(60.0)
    model: dict[tuple[str, int], tuple[str, float]] = {}
    for op, who, qs, dt in ops:
        queues = [Q[i] for i in sorted(qs)]
        live = {q: h for q, (h, at) in model.items() if clock() - at <= 60.0}
        if op == "lock":
            got = t.lock(G, who, queues, clock())
            expect = {q for q in queues if live.get(q) in (None, who)}
            assert got == expect
            for q in got:
                model[q] = (who, clock())
        elif op == "unlock":
            got = t.unlock(G, who, queues, clock())
            assert got == {q for q in queues if live.get(q) == who}
            for q in got:
                del model[q]
        elif op == "gone":
            t.release_client(who, G)
            model = {q: v for q, v in model.items() if v[0] != who}
        else:
            clock.advance(dt)
        live = {q: h for q, (h, at) in model.items() if clock() - at <= 60.0}
        assert {q: t.holder(G, *q, clock()) for q in Q} == {q: live.get(q) for q in Q}


# ---------------------------------------------------------------- across a broker restart
def test_restored_locks_are_renewed_at_the_restore_and_kept_for_their_holders():
    clock = FakeClock()
    t = QueueLockTable(60.0)
    t.lock(G, "a", Q[:2], clock())
    t.lock(G, "b", Q[2:3], clock())
    t.lock("other", "c", Q[:1], clock())
    clock.advance(50)  # a's and b's locks are 50 s old when the broker goes down
    rows = t.export(clock())
    assert rows == [(G, "T", 0, "a"), (G, "T", 1, "a"), (G, "T", 2, "b"),
                    ("other", "T", 0, "c")]

    clock.advance(30)  # the broker is down 30 s: the old locks would be expired now
    r = QueueLockTable(60.0)
    r.restore(rows, clock())
    assert r.restored_holders(G, clock()) == ["a", "b"]
    assert r.lock(G, "b", Q, clock()) == {Q[2], Q[3]}  # b back first: a's stay a's
    assert r.restored_holders(G, clock()) == ["a"]  # b locked again: a member as any
    clock.advance(59)
    assert r.lock(G, "a", Q[:2], clock()) == set(Q[:2])  # a is back within the expiry
    assert r.restored_holders(G, clock()) == []
    # a holder that never comes back frees its queues after the expiry from the restore
    assert r.holder("other", *Q[0], clock()) == "c"
    clock.advance(1.5)
    assert r.holder("other", *Q[0], clock()) is None
    assert r.restored_holders("other", clock()) == []
    assert r.lock("other", "d", Q[:1], clock()) == {Q[0]}


def test_changes_count_new_holders_and_releases_not_renewals():
    clock = FakeClock()
    t = QueueLockTable(60.0)
    t.lock(G, "a", Q[:2], clock())
    assert t.changes == 2
    t.lock(G, "a", Q[:2], clock())  # renewal: the saved file would not change
    t.lock(G, "b", Q[:2], clock())  # refused
    assert t.changes == 2
    t.unlock(G, "a", Q[:1], clock())
    t.release_client("a")
    t.drop_topic("T")
    assert t.changes == 4
    assert t.export(clock()) == []


def test_export_leaves_out_expired_locks():
    clock = FakeClock()
    t = QueueLockTable(60.0)
    t.lock(G, "a", Q[:1], clock())
    clock.advance(60.5)
    t.lock(G, "b", Q[1:2], clock())
    assert t.export(clock()) == [(G, "T", 1, "b")]


_rows = st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8),
                           st.integers(0, 2 ** 31), st.text(max_size=8)), max_size=20)


@given(_rows)
def test_lock_file_round_trip(rows):
    assert decode_lock_file(encode_lock_file(rows)) == rows


@pytest.mark.parametrize("data", [
    b"", b"\xff\xfe", b"[]", b'{"version": 2, "locks": []}', b'{"version": 1}',
    b'{"version": 1, "locks": [["g", "t", -1, "a"]]}',
    b'{"version": 1, "locks": [["g", "t", true, "a"]]}',
    b'{"version": 1, "locks": [["g", "t", 0]]}',
])
def test_a_damaged_lock_file_is_refused_with_a_reason(data):
    with pytest.raises(ValueError):
        decode_lock_file(data)
