"""Unit tests for the transition-state queue access lock (fake clock: plain floats)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.broker.access_lock import AccessLockTable, LockDecision

G, T, Q = "group", "topic", 0


def pull(table, client, requested=0, ack=-1, deliver=-1, now=0.0, queue_id=Q, topic=T, group=G):
    return table.on_pull(group, topic, queue_id, client, requested, ack, deliver, now)


# -- construction -----------------------------------------------------------------------


def test_defaults():
    table = AccessLockTable()
    assert table.hold_timeout == 30.0
    assert table.stable_checks == 3


@pytest.mark.parametrize(("hold_timeout", "stable_checks"), [(0, 3), (-1, 3), (30, -1)])
def test_invalid_parameters(hold_timeout, stable_checks):
    with pytest.raises(ValueError):
        AccessLockTable(hold_timeout=hold_timeout, stable_checks=stable_checks)


# -- free take --------------------------------------------------------------------------


def test_free_take():
    table = AccessLockTable()
    d = pull(table, "a", requested=3, ack=5, deliver=7, now=1.0)
    assert d == LockDecision(
        granted=True, offset=5, takeover="free", previous_holder=None, holder="a"
    )
    assert table.holder(G, T, Q) == "a"


def test_free_take_never_backwards_nor_minus_one():
    table = AccessLockTable()
    assert pull(table, "a", requested=9, ack=5, queue_id=0).offset == 9
    assert pull(table, "a", requested=4, ack=-1, queue_id=1).offset == 4
    assert pull(table, "a", requested=-1, ack=-1, queue_id=2).offset == -1


def test_queues_and_groups_are_independent():
    table = AccessLockTable()
    assert pull(table, "a", queue_id=0).takeover == "free"
    assert pull(table, "b", queue_id=1).takeover == "free"
    assert pull(table, "c", queue_id=0, topic="other").takeover == "free"
    assert pull(table, "d", queue_id=0, group="other").takeover == "free"
    assert table.holder(G, T, 0) == "a"
    assert table.holder(G, T, 1) == "b"
    assert table.holder(G, "other", 0) == "c"
    assert table.holder("other", T, 0) == "d"
    assert table.holder(G, T, 2) is None
    assert len(table) == 4


# -- holder refresh ---------------------------------------------------------------------


def test_holder_refresh():
    table = AccessLockTable(hold_timeout=30)
    pull(table, "a", deliver=0, now=0.0)
    d = pull(table, "a", requested=2, ack=5, deliver=4, now=20.0)
    # The holder's own requested offset is used as is (no correction).
    assert d == LockDecision(granted=True, offset=2, takeover=None, previous_holder="a", holder="a")
    (row,) = table.snapshot(G)
    assert row["last_access"] == 20.0
    assert row["last_deliver_offset"] == 4
    # Refreshed at 20: a pull by another client at 45 (< 20 + 30) is refused.
    assert not pull(table, "b", deliver=1, now=45.0).granted
    assert pull(table, "b", deliver=2, now=50.0).takeover == "timeout"


def test_holder_pull_with_moved_deliver_offset_resets_checks():
    table = AccessLockTable()
    pull(table, "a", ack=5, deliver=5)
    pull(table, "b", ack=5, deliver=5)
    pull(table, "b", ack=5, deliver=5)
    assert table.snapshot(G)[0]["unchanged_checks"] == 2
    pull(table, "a", ack=5, deliver=5)  # same deliver offset: count kept
    assert table.snapshot(G)[0]["unchanged_checks"] == 2
    pull(table, "a", ack=5, deliver=8)  # the holder got more messages
    assert table.snapshot(G)[0]["unchanged_checks"] == 0


# -- takeover: drained and stable -------------------------------------------------------


def test_drained_takeover_needs_exactly_stable_checks():
    table = AccessLockTable(hold_timeout=30, stable_checks=3)
    pull(table, "a", deliver=10, ack=10, now=0.0)
    for check in (1, 2):
        d = pull(table, "b", requested=4, ack=10, deliver=10, now=float(check))
        assert not d.granted, check
        assert table.snapshot(G)[0]["unchanged_checks"] == check
    d = pull(table, "b", requested=4, ack=10, deliver=10, now=3.0)
    assert d == LockDecision(
        granted=True, offset=10, takeover="drained", previous_holder="a", holder="b"
    )
    assert table.holder(G, T, Q) == "b"


def test_stable_but_not_drained_is_refused():
    table = AccessLockTable(stable_checks=3)
    pull(table, "a", deliver=10, ack=7)
    for i in range(10):
        assert not pull(table, "b", requested=7, ack=7, deliver=10, now=float(i)).granted
    assert table.snapshot(G)[0]["unchanged_checks"] == 10
    # Once the holder commits, the next check takes it over.
    d = pull(table, "b", requested=7, ack=10, deliver=10, now=11.0)
    assert d.takeover == "drained"
    assert d.offset == 10


def test_moving_deliver_offset_resets_count():
    table = AccessLockTable(stable_checks=3)
    pull(table, "a", deliver=10, ack=10)
    assert not pull(table, "b", ack=10, deliver=10, now=1).granted  # 1
    assert not pull(table, "b", ack=10, deliver=10, now=2).granted  # 2
    assert not pull(table, "b", ack=12, deliver=12, now=3).granted  # moved: 0
    assert table.snapshot(G)[0]["unchanged_checks"] == 0
    assert table.snapshot(G)[0]["last_deliver_offset"] == 12
    assert not pull(table, "b", ack=12, deliver=12, now=4).granted  # 1
    assert not pull(table, "b", ack=12, deliver=12, now=5).granted  # 2
    assert pull(table, "b", ack=12, deliver=12, now=6).takeover == "drained"  # 3


def test_checks_by_different_clients_accumulate():
    table = AccessLockTable(stable_checks=3)
    pull(table, "a", deliver=3, ack=3)
    assert not pull(table, "b", ack=3, deliver=3).granted
    assert not pull(table, "c", ack=3, deliver=3).granted
    d = pull(table, "b", ack=3, deliver=3)
    assert (d.takeover, d.holder, d.previous_holder) == ("drained", "b", "a")


def test_stable_checks_zero_takes_drained_queue_at_once():
    table = AccessLockTable(stable_checks=0)
    pull(table, "a", deliver=3, ack=3)
    assert pull(table, "b", deliver=3, ack=3).takeover == "drained"


# -- takeover: timeout ------------------------------------------------------------------


def test_timeout_takeover():
    table = AccessLockTable(hold_timeout=30, stable_checks=3)
    pull(table, "a", deliver=10, ack=2, now=100.0)
    assert not pull(table, "b", requested=2, ack=2, deliver=10, now=129.9).granted
    d = pull(table, "b", requested=2, ack=2, deliver=10, now=130.0)
    assert d == LockDecision(
        granted=True, offset=2, takeover="timeout", previous_holder="a", holder="b"
    )


def test_drained_wins_over_timeout_when_both_hold():
    table = AccessLockTable(hold_timeout=1, stable_checks=0)
    pull(table, "a", deliver=3, ack=3, now=0)
    assert pull(table, "b", deliver=3, ack=3, now=5).takeover == "drained"


# -- refusal ----------------------------------------------------------------------------


def test_refusal_keeps_same_offset_and_holder():
    table = AccessLockTable()
    pull(table, "a", deliver=10, ack=4, now=0)
    d = pull(table, "b", requested=2, ack=4, deliver=10, now=1)
    assert d == LockDecision(
        granted=False, offset=2, takeover=None, previous_holder="a", holder="a"
    )
    assert table.holder(G, T, Q) == "a"
    assert table.snapshot(G)[0]["pending_handover"] is True


# -- offset correction ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "ack", "expected"),
    [
        (0, 10, 10),  # forward to the ack offset
        (15, 10, 15),  # never backwards
        (5, -1, 5),  # never to -1
        (-1, -1, -1),  # requested -1 stays (the start position is resolved elsewhere)
        (-1, 0, 0),
    ],
)
def test_offset_correction_on_takeover(requested, ack, expected):
    for kind in ("drained", "timeout"):
        table = AccessLockTable(hold_timeout=30, stable_checks=0)
        deliver = ack if kind == "drained" else ack + 5
        pull(table, "a", deliver=deliver, ack=ack, now=0)
        d = pull(table, "b", requested=requested, ack=ack, deliver=deliver, now=40)
        assert d.takeover == kind
        assert d.offset == expected


# -- takeover resets the counters -------------------------------------------------------


def test_takeover_resets_counters_and_records_new_holder():
    table = AccessLockTable(hold_timeout=30, stable_checks=3)
    pull(table, "a", deliver=5, ack=5, now=0)
    for now in (1, 2, 3):
        d = pull(table, "b", deliver=5, ack=5, now=now)
    assert d.takeover == "drained"
    assert table.snapshot(G) == [
        {
            "topic": T,
            "queue_id": Q,
            "holder": "b",
            "last_access": 3,
            "last_deliver_offset": 5,
            "unchanged_checks": 0,
            "pending_handover": False,
            "unconfirmed": False,
        }
    ]
    # The old holder now needs the full stable_checks again to get it back.
    assert not pull(table, "a", deliver=5, ack=5, now=4).granted
    assert not pull(table, "a", deliver=5, ack=5, now=5).granted
    assert pull(table, "a", deliver=5, ack=5, now=6).takeover == "drained"


# -- release ----------------------------------------------------------------------------


def test_release_only_by_holder():
    table = AccessLockTable()
    pull(table, "a")
    assert table.release(group=G, topic=T, queue_id=Q, client_id="b") is False
    assert table.holder(G, T, Q) == "a"
    assert table.release(group=G, topic=T, queue_id=Q, client_id="a") is True
    assert table.holder(G, T, Q) is None
    assert table.release(group=G, topic=T, queue_id=Q, client_id="a") is False
    assert table.release(group=G, topic=T, queue_id=99, client_id="a") is False
    assert pull(table, "b", requested=0, ack=6).takeover == "free"


def test_release_client_removes_all_and_next_caller_takes_free():
    table = AccessLockTable()
    pull(table, "a", queue_id=2)
    pull(table, "a", queue_id=0)
    pull(table, "a", queue_id=1, topic="t2")
    pull(table, "a", queue_id=0, group="g2")
    pull(table, "b", queue_id=3)
    removed = table.release_client("a")
    assert removed == [("g2", T, 0), (G, "t2", 1), (G, T, 0), (G, T, 2)]
    assert [row["holder"] for row in table.snapshot(G)] == ["b"]
    assert table.release_client("a") == []
    assert table.release_client("nobody") == []
    d = pull(table, "c", requested=1, ack=8, deliver=9, queue_id=0)
    assert (d.granted, d.takeover, d.offset, d.previous_holder) == (True, "free", 8, None)


def test_release_client_after_losing_a_queue():
    table = AccessLockTable(stable_checks=0)
    pull(table, "a", queue_id=0, deliver=1, ack=1)
    pull(table, "a", queue_id=1)
    assert pull(table, "b", queue_id=0, deliver=1, ack=1).takeover == "drained"
    assert table.release_client("a") == [(G, T, 1)]
    assert table.holder(G, T, 0) == "b"


# -- touch ------------------------------------------------------------------------------


def test_touch_keeps_suspended_long_poll_holder_alive():
    table = AccessLockTable(hold_timeout=30)
    pull(table, "a", deliver=10, ack=4, now=0.0)
    # a's pull is suspended in long polling; the broker refreshes it at t=25.
    table.touch(group=G, topic=T, queue_id=Q, client_id="a", now=25.0)
    d = pull(table, "b", requested=4, ack=4, deliver=10, now=40.0)
    assert not d.granted
    assert d.holder == "a"
    # Without further refresh the timeout eventually applies (hung but connected).
    assert pull(table, "b", requested=4, ack=4, deliver=10, now=55.0).takeover == "timeout"


def test_touch_by_non_holder_does_nothing():
    table = AccessLockTable(hold_timeout=30)
    pull(table, "a", deliver=10, now=0.0)
    table.touch(group=G, topic=T, queue_id=Q, client_id="b", now=25.0)
    # an unlocked queue: no entry created
    table.touch(group=G, topic=T, queue_id=7, client_id="a", now=25.0)
    assert table.snapshot(G)[0]["last_access"] == 0.0
    assert table.holder(G, T, 7) is None
    assert pull(table, "b", deliver=10, now=30.0).takeover == "timeout"


def test_touch_never_moves_access_time_backwards():
    table = AccessLockTable()
    pull(table, "a", now=10.0)
    table.touch(group=G, topic=T, queue_id=Q, client_id="a", now=5.0)
    table.touch_client("a", now=3.0)
    assert table.snapshot(G)[0]["last_access"] == 10.0


def test_touch_client_refreshes_every_lock_of_the_client():
    table = AccessLockTable(hold_timeout=30)
    pull(table, "a", queue_id=0, deliver=5, now=0.0)
    pull(table, "a", queue_id=1, deliver=5, now=0.0)
    pull(table, "b", queue_id=2, deliver=5, now=0.0)
    table.touch_client("a", now=20.0)  # heartbeat
    table.touch_client("nobody", now=20.0)
    assert [row["last_access"] for row in table.snapshot(G)] == [20.0, 20.0, 0.0]
    assert not pull(table, "c", queue_id=0, deliver=5, now=35.0).granted
    assert not pull(table, "c", queue_id=1, deliver=5, now=35.0).granted
    assert pull(table, "c", queue_id=2, deliver=5, now=35.0).takeover == "timeout"


# -- snapshot ---------------------------------------------------------------------------


def test_snapshot_content():
    table = AccessLockTable()
    assert table.snapshot(G) == []
    pull(table, "a", topic="t2", queue_id=1, deliver=8, ack=6, now=1.5)
    pull(table, "a", topic="t1", queue_id=3, deliver=2, ack=2, now=2.0)
    pull(table, "x", group="other", deliver=1, now=0.0)
    pull(table, "b", topic="t1", queue_id=3, deliver=2, ack=2, now=2.5)  # check 1, refused
    assert table.snapshot(G) == [
        {
            "topic": "t1",
            "queue_id": 3,
            "holder": "a",
            "last_access": 2.0,
            "last_deliver_offset": 2,
            "unchanged_checks": 1,
            "pending_handover": True,
            "unconfirmed": False,
        },
        {
            "topic": "t2",
            "queue_id": 1,
            "holder": "a",
            "last_access": 1.5,
            "last_deliver_offset": 8,
            "unchanged_checks": 0,
            "pending_handover": False,
            "unconfirmed": False,
        },
    ]
    assert [row["holder"] for row in table.snapshot("other")] == ["x"]
    assert table.snapshot("missing") == []


# -- property ---------------------------------------------------------------------------

_CLIENTS = ["c1", "c2", "c3"]
_QUEUES = [0, 1]

_pull_op = st.tuples(
    st.just("pull"),
    st.sampled_from(_CLIENTS),
    st.sampled_from(_QUEUES),
    st.integers(-1, 20),  # requested offset
    st.integers(-1, 20),  # ack offset
    st.integers(0, 3),  # deliver - ack (deliver is never below ack)
    st.floats(0, 20, allow_nan=False),  # time step
)
_other_op = st.tuples(
    st.sampled_from(["touch", "touch_client", "release", "release_client"]),
    st.sampled_from(_CLIENTS),
    st.sampled_from(_QUEUES),
    st.floats(0, 20, allow_nan=False),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.one_of(_pull_op, _pull_op, _other_op), max_size=60),
    hold_timeout=st.sampled_from([5.0, 30.0]),
    stable_checks=st.integers(0, 3),
)
def test_property_single_holder_and_offsets(ops, hold_timeout, stable_checks):
    table = AccessLockTable(hold_timeout=hold_timeout, stable_checks=stable_checks)
    model: dict[int, str | None] = dict.fromkeys(_QUEUES)
    now = 0.0
    for op in ops:
        kind, client, queue_id = op[0], op[1], op[2]
        if kind == "pull":
            _, _, _, requested, ack, extra, step = op
            now += step
            deliver = ack + extra if ack >= 0 else extra - 1
            before = model[queue_id]
            d = pull(table, client, requested, ack, deliver, now, queue_id=queue_id)
            assert d.previous_holder == before
            if d.granted:
                assert d.holder == client
                assert d.offset >= requested
                assert d.offset != -1 or requested == -1
                assert (d.takeover is None) == (before == client)
                if before is None:
                    assert d.takeover == "free"
                elif before != client:
                    assert d.takeover in ("drained", "timeout")
            else:
                assert before is not None
                assert before != client
                assert d.holder == before
                assert d.offset == requested
                assert d.takeover is None
            model[queue_id] = d.holder
        elif kind == "touch":
            now += op[3]
            table.touch(group=G, topic=T, queue_id=queue_id, client_id=client, now=now)
        elif kind == "touch_client":
            now += op[3]
            table.touch_client(client, now)
        elif kind == "release":
            released = table.release(group=G, topic=T, queue_id=queue_id, client_id=client)
            assert released == (model[queue_id] == client)
            if released:
                model[queue_id] = None
        else:
            removed = table.release_client(client)
            expected = sorted((G, T, q) for q, h in model.items() if h == client)
            assert removed == expected
            for _, _, q in removed:
                model[q] = None
        # At most one holder per queue, and the table agrees with the model.
        for q in _QUEUES:
            assert table.holder(G, T, q) == model[q]
        rows = table.snapshot(G)
        assert len({row["queue_id"] for row in rows}) == len(rows)
        assert {row["queue_id"]: row["holder"] for row in rows} == {
            q: h for q, h in model.items() if h is not None
        }
