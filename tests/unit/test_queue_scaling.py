"""The decisions of queues that follow a group (``broker/queue_scaling.py``): pure, no
sockets, no store."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.broker.queue_scaling import (
    Gate,
    Layout,
    ScalingState,
    decide,
    moved_from,
    target_queues,
)

counts = st.integers(1, 64)


@st.composite
def bounds(draw: st.DrawFn) -> tuple[int, int]:
    lo = draw(st.integers(1, 32))
    return lo, draw(st.integers(lo, 64))


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    write = draw(counts)
    return Layout(draw(st.integers(write, 80)), write)


def test_target_is_the_next_power_of_two_within_bounds():
    assert [target_queues(n, 1, 16) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert target_queues(40, 1, 16) == 16
    assert target_queues(1, 3, 16) == 3
    assert target_queues(5, 1, 6) == 6
    with pytest.raises(ValueError):
        target_queues(1, 4, 2)


@given(st.integers(0, 2000), bounds())
def test_target_within_bounds_and_enough_queues(members, b):
    lo, hi = b
    n = target_queues(members, lo, hi)
    assert lo <= n <= hi
    if n < hi:  # not capped: every member can own a queue
        assert n >= members
    if lo < n < hi:
        assert n & (n - 1) == 0


@settings(max_examples=400)
@given(st.integers(0, 100), layouts(), bounds(), st.booleans(), st.data())
def test_decide_invariants(members, current, b, changing, data):
    lo, hi = b
    draining = range(current.write, current.read)
    drained = set(data.draw(st.lists(st.sampled_from(draining), unique=True))
                  if draining else [])
    new = decide(members=members, current=current, lo=lo, hi=hi, changing=changing,
                 drained=drained)
    assert new.read >= new.write >= 1  # never fewer read than written queues
    if changing:
        assert new.write == current.write  # a change in flight: the write count holds
    else:
        assert lo <= new.write <= hi
        assert new.write == target_queues(members, lo, hi)
    # a queue leaves reading only when it was draining and is drained
    for q in range(new.read, current.read):
        assert q in drained
        assert q >= current.write
    # reading grows only to cover new writes
    assert new.read <= max(current.read, new.write)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 20), st.booleans(), st.integers(0, 2**16)),
                min_size=1, max_size=40), bounds())
def test_decide_over_time_never_strands_a_queue(steps, b):
    """A run of decisions with queues draining at random: every queue ever written stays
    readable until it is drained, and written queues are always read."""
    lo, hi = b
    layout = Layout(lo, lo)
    ever_written = set(range(lo))
    consumed: set[int] = set()  # drained (written no more and consumed to its end)
    for members, changing, seed in steps:
        draining = list(range(layout.write, layout.read))
        consumed = {q for q in consumed if q >= layout.write}
        consumed |= {q for i, q in enumerate(draining) if seed >> (i % 16) & 1}
        new = decide(members=members, current=layout, lo=lo, hi=hi, changing=changing,
                     drained=consumed)
        for q in ever_written - consumed:
            assert q < new.read, (q, layout, new)
        ever_written |= set(range(new.write))
        consumed -= set(range(new.write))  # written again: not drained any more
        layout = new
        assert layout.read >= layout.write


def test_moved_from_doubling_and_halving():
    assert moved_from(4, 8) == {4: [0], 5: [1], 6: [2], 7: [3]}
    assert moved_from(8, 4) == {0: [4], 1: [5], 2: [6], 3: [7]}
    assert moved_from(1, 8) == {j: [0] for j in range(1, 8)}
    assert moved_from(8, 1) == {0: list(range(1, 8))}
    assert moved_from(4, 4) == {}


@given(counts, counts, st.integers(0, 2**32))
def test_moved_from_covers_every_key_that_moves(old, new, h):
    moved = moved_from(old, new)
    i, j = h % old, h % new
    if i != j:
        assert i in moved[j]


@given(counts, counts)
def test_moved_from_lists_only_queues_a_key_can_come_from(old, new):
    lcm = old * new // math.gcd(old, new)
    reach: dict[int, set[int]] = {}
    for h in range(lcm):  # every residue pair occurs below lcm(old, new)
        if h % old != h % new:
            reach.setdefault(h % new, set()).add(h % old)
    assert {j: set(ps) for j, ps in moved_from(old, new).items()} == reach


def test_state_round_trip():
    s = ScalingState("g", 1, 16, True, 123, 8, {4: 10, 5: None},
                     {0: [Gate(7, {4: 10, 5: None})]})
    raw = s.to_json()
    assert ScalingState.from_json(raw) == s
    import json
    assert ScalingState.from_json(json.loads(json.dumps(raw))) == s


@pytest.mark.parametrize("raw", [
    None, [], {"group": "g"}, {"group": 3, "min": 1, "max": 2, "key_order": True,
                               "grace_until_ms": 0, "grace_from": 0, "drains": {},
                               "gates": {}},
    {"group": "g", "min": 4, "max": 2, "key_order": True, "grace_until_ms": 0,
     "grace_from": 0, "drains": {}, "gates": {}},
    {"group": "g", "min": 1, "max": 2, "key_order": True, "grace_until_ms": 0,
     "grace_from": 0, "drains": {"x": 1}, "gates": {}},
    {"group": "g", "min": 1, "max": 2, "key_order": True, "grace_until_ms": 0,
     "grace_from": 0, "drains": {}, "gates": {"1": [{"start": -1, "parents": {}}]}},
])
def test_bad_state_is_refused(raw):
    with pytest.raises(ValueError):
        ScalingState.from_json(raw)
