"""Delayed messages without a broker: the timer's levels and due times (pure), and the
schedule service on a store with a fake clock: delivery at the time and in time order,
never early, once each, also when the process is killed at any write and the store
reopened."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.broker.retry import SCHEDULE_GROUP, RetryService, parse_delay_levels
from onceq.log.delay import (
    DELAYED,
    MAX_TIMER_MS,
    PROP_TIMER_DELIVER_MS,
    TIMER_BASE_MS,
    TIMER_LEVELS,
    TIMER_TOPIC,
    DelayError,
    check_delay,
    deliver_ms_of,
    is_delayed,
    level_ms,
    parse_deliver_ms,
    set_flag,
    timer_due,
    timer_level,
)
from onceq.log.record import MessageExt, decode_records, encode_part
from onceq.protocol.codes import PROP_REAL_QUEUE, PROP_REAL_TOPIC, PullStatus
from onceq.protocol.errors import ErrorCode, OnceqError
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.helpers import kill_store, small_store

T0 = 1_700_000_000.0
NOW_MS = int(T0 * 1000)
DAY_MS = 86_400_000
MAX_DELAY_S = 3 * 86400.0


# ------------------------------------------------------------------ pure
@given(st.integers(min_value=-DAY_MS, max_value=400 * DAY_MS))
def test_the_level_is_the_longest_not_longer_than_the_time_left(remaining):
    level = timer_level(remaining)
    assert 0 <= level < TIMER_LEVELS
    if remaining >= TIMER_BASE_MS:
        assert level_ms(level) <= remaining
    if level < TIMER_LEVELS - 1:
        assert remaining < level_ms(level + 1)


@given(st.integers(min_value=0, max_value=10**13), st.integers(0, TIMER_LEVELS - 1),
       st.integers(min_value=0, max_value=10**13))
def test_a_due_time_is_never_before_the_delivery_and_bounded_by_the_level(store_ms, level,
                                                                        deliver_ms):
    when, deliver = timer_due(store_ms, level, deliver_ms)
    assert store_ms <= when < store_ms + level_ms(level) + TIMER_BASE_MS
    if deliver:
        assert when >= deliver_ms
    else:
        assert when == store_ms + level_ms(level) and deliver_ms - when >= TIMER_BASE_MS


def test_delivery_times_are_checked():
    assert parse_deliver_ms("1700000000000") == 1_700_000_000_000
    for bad in (None, "", "-1", " 1", "1.5", "٣", "9" * 19, 12):
        with pytest.raises(DelayError, match=PROP_TIMER_DELIVER_MS):
            parse_deliver_ms(bad)
    check_delay(NOW_MS - 10**9, NOW_MS, 60)  # the past: delivered at once
    check_delay(NOW_MS + 60_000, NOW_MS, 60)
    with pytest.raises(DelayError, match="timer_max_delay_s"):
        check_delay(NOW_MS + 60_001, NOW_MS, 60)
    assert deliver_ms_of(None, 1.5, T0) == NOW_MS + 1500
    assert deliver_ms_of(T0 + 2, None, 0) == NOW_MS + 2000
    for args in ((None, None), (T0, 1.0), (float("nan"), None), (None, float("inf"))):
        with pytest.raises(ValueError):
            deliver_ms_of(*args, T0)


def test_the_flag_is_read_from_the_header():
    part = encode_part(b"x", "K", 1, properties={PROP_TIMER_DELIVER_MS: "5"})
    assert not is_delayed(part)
    flagged = set_flag(part)
    assert is_delayed(flagged) and is_delayed(memoryview(flagged))
    assert encode_part(b"x", "K", 1, properties={PROP_TIMER_DELIVER_MS: "5"},
                       flags=DELAYED) == flagged
    assert not is_delayed(b"short")


# ------------------------------------------------------------------ the service
def open_store(path: str, clock: FakeClock, **kw: object) -> MessageStore:
    store = MessageStore(small_store(path, **kw), clock=clock)
    store.open()
    return store


def service(store: MessageStore, clock: FakeClock) -> RetryService:
    return RetryService(store, parse_delay_levels("1s 5s"), clock, lambda t, q: None)


def delayed(key: str, deliver_ms: int, props: dict | None = None) -> bytes:
    return encode_part(key.encode(), key, 1, "tg", "k1 k2",
                       {**(props or {}), PROP_TIMER_DELIVER_MS: str(deliver_ms)}, DELAYED)


def read(store: MessageStore, topic: str, queue: int = 0) -> list[MessageExt]:
    if topic not in store.topics:
        return []
    r = store.get(topic, queue, 0, 100_000, 64 * 1024 * 1024)
    return list(decode_records(r.payload)) if r.status == PullStatus.FOUND else []


@pytest.fixture
def env(tmp_path):
    clock = FakeClock(T0)
    store = open_store(str(tmp_path / "d"), clock)
    store.create_topic("t", 2)
    yield store, service(store, clock), clock
    store.close()


def run_until(retry: RetryService, clock: FakeClock, end_ms: int, step_ms: int = 50) -> None:
    """Run the service as its loop would, the fake clock moving by what it asks (at most
    ``step_ms``: the test checks the time of each delivery), until ``end_ms``."""
    while clock() * 1000 < end_ms:
        wait_ms = retry.deliver_due() * 1000
        clock.advance(max(min(wait_ms, step_ms), 1) / 1000)
    retry.deliver_due()


def test_a_delayed_message_is_stored_at_once_and_delivered_at_its_time(env):
    store, retry, clock = env
    res = retry.send_delayed("t", 1, delayed("A", NOW_MS + 5_000, {"p": "v"}), MAX_DELAY_S)
    assert not res.duplicates
    assert read(store, "t", 1) == []
    clock.advance(4.9)
    retry.deliver_due()
    assert read(store, "t", 1) == []
    run_until(retry, clock, NOW_MS + 5_200)
    [m] = read(store, "t", 1)
    assert (m.unique_key, m.body, m.tags, m.keys, m.born_ts_ms) == ("A", b"A", "tg", "k1 k2", 1)
    assert m.properties == {"p": "v", PROP_TIMER_DELIVER_MS: str(NOW_MS + 5_000)}
    assert NOW_MS + 5_000 <= m.store_ts_ms <= NOW_MS + 5_000 + TIMER_BASE_MS
    assert not m.flags & DELAYED


def test_a_time_in_the_past_delivers_at_once_and_retries_are_duplicates(env):
    store, retry, _clock = env
    part = delayed("P", NOW_MS - 60_000)
    retry.send_delayed("t", 0, part, MAX_DELAY_S)
    assert retry.send_delayed("t", 0, part, MAX_DELAY_S).duplicates == [0]
    retry.deliver_due()
    assert [m.unique_key for m in read(store, "t")] == ["P"]


def test_refused_delays(env):
    _store, retry, _clock = env
    with pytest.raises(OnceqError) as e:
        retry.send_delayed("t", 0, delayed("F", NOW_MS + int(MAX_DELAY_S * 1000) + 1),
                           MAX_DELAY_S)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert "timer_max_delay_s" in e.value.message
    bad = encode_part(b"x", "B", 1, properties={PROP_TIMER_DELIVER_MS: "soon"},
                      flags=DELAYED)
    with pytest.raises(OnceqError) as e:
        retry.send_delayed("t", 0, bad, MAX_DELAY_S)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert PROP_TIMER_DELIVER_MS in e.value.message


@pytest.mark.parametrize("target", ["%RETRY%g", "%OFFSETS%", "%SCHEDULE%", "", 7])
def test_a_timer_record_aimed_at_a_system_topic_is_skipped(env, target):
    store, retry, _clock = env
    retry.ensure_timer_topic()
    store.put(TIMER_TOPIC, 0, [encode_part(b"x", "F", 1, properties={
        PROP_REAL_TOPIC: target, PROP_REAL_QUEUE: "0", PROP_TIMER_DELIVER_MS: "0"})],
        dedup=False)
    retry.send_delayed("t", 0, delayed("OK", 0), MAX_DELAY_S)
    retry.deliver_due()
    assert retry.skipped == 1
    assert [m.unique_key for m in read(store, "t")] == ["OK"]
    assert store.get_offset(SCHEDULE_GROUP, TIMER_TOPIC, 0) == 2


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=-2_000, max_value=2 * DAY_MS), min_size=1,
                max_size=12))
def test_many_delays_each_delivered_once_in_time_order_never_early(tmp_path_factory, delays):
    clock = FakeClock(T0)
    store = open_store(str(tmp_path_factory.mktemp("d")), clock)
    try:
        store.create_topic("t", 1)
        retry = service(store, clock)
        want = {}
        due = {}  # a time in the past: at once, in the order sent
        for i, d in enumerate(delays):
            want[f"K{i}"] = NOW_MS + d
            due[f"K{i}"] = max(NOW_MS + d, int(clock() * 1000))
            retry.send_delayed("t", 0, delayed(f"K{i}", NOW_MS + d), MAX_DELAY_S)
            clock.advance(0.001)
        end = max(want.values()) + 1_000
        run_until(retry, clock, end, step_ms=3_600_000)
        got = read(store, "t")
        assert sorted(m.unique_key for m in got) == sorted(want)
        for m in got:
            assert m.store_ts_ms >= want[m.unique_key]
        # in time order, within two of the shortest levels (a head waits in its queue)
        times = [due[m.unique_key] for m in got]
        assert all(b >= a - 2 * TIMER_BASE_MS for a, b in itertools.pairwise(times))
        # no waiting copy older than the longest level: retention cannot take one
        for q in range(TIMER_LEVELS):
            assert store.get_offset(SCHEDULE_GROUP, TIMER_TOPIC, q) in (
                -1, store.min_max(TIMER_TOPIC, q)[1])
    finally:
        store.close()


def test_timely_with_a_clock_that_moves_by_small_steps(env):
    """Precision: each message is in its queue within ~ the shortest level of its time."""
    store, retry, clock = env
    delays = [300, 2_000, 1_000, 45_000, 7_300, 125, 3_600_000]
    for i, d in enumerate(delays):
        retry.send_delayed("t", 0, delayed(f"K{i}", NOW_MS + d), MAX_DELAY_S)
    run_until(retry, clock, NOW_MS + max(delays) + 500, step_ms=1000)
    got = read(store, "t")
    assert [m.unique_key for m in got] == [f"K{i}" for i in sorted(
        range(len(delays)), key=delays.__getitem__)]
    for m in got:
        late = m.store_ts_ms - int(m.properties[PROP_TIMER_DELIVER_MS])
        assert 0 <= late <= TIMER_BASE_MS, (m.unique_key, late)


class Crash(BaseException):
    """The process dies here (not an Exception: nothing catches it)."""


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(min_value=1, max_value=60),
       st.lists(st.integers(min_value=0, max_value=20_000), min_size=1, max_size=6))
def test_killed_at_any_write_each_message_is_delivered_once(tmp_path_factory, crash_at,
                                                             delays):
    """The process dies at the ``crash_at``-th write of the service (a move or a progress
    commit), the store is reopened as after a SIGKILL and a new service goes on: every
    message is delivered once. The dedup window is off, so that the check of the first
    move of each queue after the start is what prevents a second copy."""
    path = str(tmp_path_factory.mktemp("d"))
    clock = FakeClock(T0)
    store = open_store(path, clock, dedup_window_s=0)
    store.create_topic("t", 1)
    retry = service(store, clock)
    for i, d in enumerate(delays):
        retry.send_delayed("t", 0, delayed(f"K{i}", NOW_MS + d), MAX_DELAY_S)
    writes = 0

    def counting(fn):
        def wrapped(*a, **kw):
            nonlocal writes
            writes += 1
            if writes == crash_at:
                raise Crash
            return fn(*a, **kw)
        return wrapped

    real_put = store.put
    store.put = counting(real_put)  # type: ignore[method-assign]
    store.commit_offset = counting(store.commit_offset)  # type: ignore[method-assign]
    end = NOW_MS + max(delays) + 1_000
    try:
        run_until(retry, clock, end)
    except Crash:
        kill_store(store)
        store = open_store(path, clock, dedup_window_s=0)
        retry = service(store, clock)
        run_until(retry, clock, end)
    try:
        got = sorted(m.unique_key for m in read(store, "t"))
        assert got == sorted(f"K{i}" for i in range(len(delays)))
    finally:
        store.close()


def test_a_retry_moved_before_a_kill_is_not_moved_again(tmp_path):
    """The consumer retries' schedule gets the same check: a retry copied into the group's
    retry topic just before the kill (its progress not saved) is not copied again."""
    path = str(tmp_path / "d")
    clock = FakeClock(T0)
    store = open_store(path, clock, dedup_window_s=0)
    store.create_topic("t", 1)
    store.put("t", 0, [encode_part(b"a", "A", 1)])
    retry = service(store, clock)
    retry.ensure_topics()
    retry.send_back("g", "t", 0, 0, 1, 16)
    clock.advance(1.0)

    def crash(*_a, **_kw):
        raise Crash

    store.commit_offset = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        retry.deliver_due()
    kill_store(store)
    store = open_store(path, clock, dedup_window_s=0)
    try:
        retry = service(store, clock)
        retry.deliver_due()
        assert [m.unique_key for m in read(store, "%RETRY%g")] == ["A"]
        assert store.get_offset(SCHEDULE_GROUP, "%SCHEDULE%", 0) == 1
    finally:
        store.close()


def test_the_longest_level_bounds_every_wait(env):
    """A message due in three days is copied on at least every MAX_TIMER_MS."""
    store, retry, clock = env
    retry.send_delayed("t", 0, delayed("L", NOW_MS + 3 * DAY_MS), MAX_DELAY_S)
    assert read(store, TIMER_TOPIC, TIMER_LEVELS - 1)[0].unique_key == "L"
    seen = 0
    while clock() * 1000 < NOW_MS + 3 * DAY_MS + 1_000:
        clock.advance(max(min(retry.deliver_due(), MAX_TIMER_MS / 1000), 0.001))
        waiting = [m for q in range(TIMER_LEVELS) for m in read(store, TIMER_TOPIC, q)
                   if m.queue_offset >= store.get_offset(SCHEDULE_GROUP, TIMER_TOPIC, q)]
        for m in waiting:
            assert clock() * 1000 - m.store_ts_ms <= MAX_TIMER_MS + TIMER_BASE_MS
        seen += 1
    retry.deliver_due()
    assert [m.unique_key for m in read(store, "t")] == ["L"]
    assert seen < 200
