"""The fence of a forced offset reset (pure)."""

from __future__ import annotations

import pytest

from onceq.broker.offset_reset import ResetFence, clamp


def test_fence_blocks_until_the_generation_is_seen():
    f = ResetFence()
    gen = f.add("g", ["a", "b"], {("t", 0), ("t", 1)}, now=1000.0)
    assert gen == 1_000_000  # from the clock in ms: later than any before a restart
    assert f.blocks("g", "a", "t", 0) and f.blocks("g", "b", "t", 1)
    assert not f.blocks("g", "a", "t", 2) and not f.blocks("g", "c", "t", 0)
    assert not f.blocks(None, "a", "t", 0) and not f.blocks("g", None, "t", 0)
    assert f.pending("g", "a") == {"group": "g", "gen": gen, "queues": [["t", 0], ["t", 1]]}
    f.seen("g", "a", gen - 1)  # an older generation changes nothing
    f.seen("g", "a", True)  # nor a bool
    assert f.blocks("g", "a", "t", 0)
    f.seen("g", "a", gen)
    assert not f.blocks("g", "a", "t", 0) and f.pending("g", "a") is None
    assert f.blocks("g", "b", "t", 0)


def test_a_second_reset_before_the_first_was_seen_keeps_both_and_the_new_generation():
    f = ResetFence()
    g1 = f.add("g", ["a"], {("t", 0)}, now=5.0)
    g2 = f.add("g", ["a"], {("u", 3)}, now=5.0)  # same ms: still a later generation
    assert g2 == g1 + 1
    f.seen("g", "a", g1)
    assert f.blocks("g", "a", "t", 0) and f.blocks("g", "a", "u", 3)
    f.seen("g", "a", g2)
    assert not f.blocks("g", "a", "u", 3)


def test_fences_go_with_the_topic_the_client_and_age():
    f = ResetFence()
    f.add("g", ["a", "b", "c"], {("t", 0), ("u", 0)}, now=0.0)
    f.drop_topic("t")
    assert not f.blocks("g", "a", "t", 0) and f.blocks("g", "a", "u", 0)
    f.drop_topic("u")
    assert f.pending("g", "a") is None
    f.add("g", ["a", "b", "c"], {("t", 0)}, now=10.0)
    f.drop_client("g", "a")
    assert not f.blocks("g", "a", "t", 0)
    f.expire(50.0, 100.0, lambda g, c: False)  # too young
    assert f.blocks("g", "b", "t", 0)
    f.expire(200.0, 100.0, lambda g, c: c == "c")  # c is still a member: kept
    assert not f.blocks("g", "b", "t", 0) and f.blocks("g", "c", "t", 0)


def test_clamp():
    assert [clamp(x, 3, 9) for x in (-1, 3, 5, 9, 12)] == [3, 3, 5, 9, 9]


def test_fences_survive_encode_and_restore_and_changes_are_counted():
    f = ResetFence()
    gen = f.add("g", ["a", "b"], {("t", 0), ("t", 1)}, 1000.0)
    f.seen("g", "b", gen)  # b handled it
    assert f.changes == 2 and len(f) == 1
    f.seen("g", "b", gen)  # nothing left to clear: no change
    f.drop_client("g", "nobody")
    assert f.changes == 2

    r = ResetFence()
    assert r.restore(f.encode()) == 1
    assert r.last_gen == f.last_gen == gen
    assert r.blocks("g", "a", "t", 1) and not r.blocks("g", "b", "t", 1)
    assert r.pending("g", "a") == {"group": "g", "gen": gen, "queues": [["t", 0], ["t", 1]]}
    assert r.encode() == f.encode()
    # a later reset still gets a higher generation than any saved one
    assert r.add("g", ["a"], {("t", 0)}, 999.0) > gen


@pytest.mark.parametrize("data", [
    b"", b"{", b"[]", b'{"version": 2, "last_gen": 1, "fences": []}',
    b'{"version": 1, "last_gen": "1", "fences": []}',
    b'{"version": 1, "last_gen": 1, "fences": [["g", "a", 1, 0.0, [["t", "0"]]]]}',
    b'{"version": 1, "last_gen": 1, "fences": [["g", "a", 1]]}',
    # a generation no reply can carry (msgpack's widest integer is 64 bits)
    b'{"version": 1, "last_gen": 18446744073709551616, "fences": []}',
    b'{"version": 1, "last_gen": 1, "fences": [["g", "a", 18446744073709551616, 0.0, []]]}',
])
def test_a_damaged_fence_file_is_refused_with_a_reason(data):
    f = ResetFence()
    f.add("g", ["a"], {("t", 0)}, 5.0)
    with pytest.raises(ValueError):
        f.restore(data)
    assert f.blocks("g", "a", "t", 0)  # left as it was
