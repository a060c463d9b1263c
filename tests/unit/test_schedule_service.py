"""The schedule service against any record in ``%SCHEDULE%``: undeliverable records are
skipped and counted, never delivered and never stalling a level; only group retry topics
are targets; the reconsume count saturates at its u16 limit and the message is
dead-lettered. A store and the service with a fake clock, no broker."""

from __future__ import annotations

import logging

import pytest

from onceq.broker.retry import SCHEDULE_GROUP, RetryService, parse_delay_levels
from onceq.log.offset_record import OFFSETS_TOPIC, OffsetCommit, decode_commit, encode_commit
from onceq.log.record import MessageExt, decode_records, encode_part
from onceq.protocol.codes import (
    PROP_DELIVER_AT,
    PROP_DLQ_REASON,
    PROP_REAL_QUEUE,
    PROP_REAL_TOPIC,
    SCHEDULE_TOPIC,
    TRACE_TOPIC,
    PullStatus,
    dlq_topic,
    retry_topic,
)
from onceq.protocol.replies import SendBackReply
from onceq.storage.store import MessageStore
from tests.clock import FakeClock
from tests.helpers import small_store

T0 = 1_700_000_000.0
MAX_RECONSUME_TIMES = 0xFFFF  # a message part's reconsume count is a u16
NOW_MS = int(T0 * 1000)
RETRY_G = retry_topic("g")


@pytest.fixture
def env(tmp_path):
    """(store, schedule service, clock): topic ``t`` (1 queue) holds message ``A`` at 0;
    delay levels 1 s, 5 s, 10 s."""
    clock = FakeClock(T0)
    store = MessageStore(small_store(str(tmp_path / "d")), clock=clock)
    store.open()
    store.create_topic("t", 1)
    store.put("t", 0, [encode_part(b"a", "A", 1)])
    retry = RetryService(store, parse_delay_levels("1s 5s 10s"), clock, lambda t, q: None)
    retry.ensure_topics()
    retry.ensure_group_topics("g")
    yield store, retry, clock
    store.close()


def scheduled(props: dict, key: str = "F", body: bytes = b"forged") -> bytes:
    return encode_part(body, key, 1, properties=props)


def target(topic: str = RETRY_G, due: object = "0") -> dict:
    return {PROP_REAL_TOPIC: topic, PROP_REAL_QUEUE: "0", PROP_DELIVER_AT: due}


def read(store: MessageStore, topic: str, queue: int = 0) -> list[MessageExt]:
    if topic not in store.topics:
        return []
    r = store.get(topic, queue, 0, 1000, 16 * 1024 * 1024)
    return list(decode_records(r.payload)) if r.status == PullStatus.FOUND else []


BAD = [
    target(due=["not", "a", "time"]),  # int() of it raises TypeError
    target(due=1e400),  # a float infinity: int() raises OverflowError
    target(due="9" * 400),  # an int no float holds: the wait cannot be computed
    target(due=None),
    target(due="soon"),
    target(due="-5"),
    target(due=" 12"),
    {**target(), PROP_REAL_QUEUE: "x"},
    {**target(), PROP_REAL_QUEUE: "1"},  # a retry topic has one queue
    {PROP_DELIVER_AT: "0"},  # no target
    target(topic=7),
]


def test_undeliverable_records_are_skipped_counted_and_logged_once(env, caplog):
    """Records a client could once store in the schedule topic: none stops the service
    (it raised on each of them every second, for every group), none is delivered, each
    is counted; the retry stored behind them is delivered when due."""
    store, retry, clock = env
    store.put(SCHEDULE_TOPIC, 0, [scheduled(p, key=f"BAD{i}") for i, p in enumerate(BAD)],
              dedup=False)
    retry.send_back("g", "t", 0, 0, 1, 16)  # level 1 (queue 0), behind the bad records
    clock.advance(1.5)
    with caplog.at_level(logging.ERROR, logger="onceq.broker"):
        assert retry.deliver_due() == float("inf")
    assert [(m.body, m.reconsume_times) for m in read(store, RETRY_G)] == [(b"a", 1)]
    assert retry.skipped == len(BAD)
    assert store.get_offset(SCHEDULE_GROUP, SCHEDULE_TOPIC, 0) == len(BAD) + 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and all("skipped the record" in r.getMessage() for r in errors)
    caplog.clear()
    clock.advance(60)  # past the log's rate limit: a skipped record is not read again
    with caplog.at_level(logging.ERROR, logger="onceq.broker"):
        retry.deliver_due()
    assert retry.skipped == len(BAD) and not caplog.records


def test_a_far_future_due_time_does_not_hold_up_its_level(env):
    """A due time is bounded by the record's store time plus its level's delay: a record
    due in ten years at the head of a level is delivered at that bound, and the retries
    behind it on time."""
    store, retry, clock = env
    ten_years = NOW_MS + 10 * 365 * 86400 * 1000
    store.put(SCHEDULE_TOPIC, 0, [scheduled(target(due=str(ten_years)), key="FAR")],
              dedup=False)
    retry.send_back("g", "t", 0, 0, 1, 16)  # due in 1 s
    clock.advance(0.5)
    assert 0 < retry.deliver_due() <= 0.5
    assert read(store, RETRY_G) == []
    clock.advance(0.5)
    assert retry.deliver_due() == float("inf")
    assert [m.unique_key for m in read(store, RETRY_G)] == ["FAR", "A"]


def test_the_broker_s_own_due_times_are_kept(env):
    """The bound never brings a retry the broker scheduled forward: level 2 waits 5 s."""
    store, retry, clock = env
    retry.send_back("g", "t", 0, 0, 2, 16)
    clock.advance(4.99)
    assert 0 < retry.deliver_due() <= 0.011
    assert read(store, RETRY_G) == []
    clock.advance(0.01)
    retry.deliver_due()
    assert [m.body for m in read(store, RETRY_G)] == [b"a"]


def test_a_queue_past_the_configured_levels_is_bounded_by_the_longest_delay(env):
    store, retry, clock = env
    store.create_topic(SCHEDULE_TOPIC, 5)  # left by a broker with more delay levels
    store.put(SCHEDULE_TOPIC, 4, [scheduled(target(due=str(NOW_MS + 3600_000)))],
              dedup=False)
    clock.advance(9.9)
    assert 0 < retry.deliver_due() <= 0.1
    clock.advance(0.1)
    retry.deliver_due()
    assert [m.unique_key for m in read(store, RETRY_G)] == ["F"]


@pytest.mark.parametrize("topic", [OFFSETS_TOPIC, SCHEDULE_TOPIC, TRACE_TOPIC, dlq_topic("g"),
                                   "t", "%RETRY%", "%RETRY%a b"])
def test_only_a_group_retry_topic_is_a_target(env, topic):
    """A schedule record aimed at the offsets journal (a forged commit that bypasses the
    commit rule), another system topic or a user topic is skipped, not delivered."""
    store, retry, _clock = env
    store.commit_offset("other", "t", 0, 1)  # the offsets journal exists
    for t in (TRACE_TOPIC, dlq_topic("g")):
        store.create_topic(t, 1)
    before = {t: store.min_max(t, 0) for t in store.topics}
    forged = encode_commit(OffsetCommit("victim", "t", 0, 1))
    store.put(SCHEDULE_TOPIC, 0, [scheduled(target(topic=topic), body=forged)], dedup=False)
    retry.deliver_due()
    after = {t: store.min_max(t, 0) for t in before}
    after[SCHEDULE_TOPIC] = before[SCHEDULE_TOPIC]  # the forged record itself
    after[OFFSETS_TOPIC] = before[OFFSETS_TOPIC]  # the service's own progress, below
    assert after == before
    commits = [decode_commit(m.body) for m in read(store, OFFSETS_TOPIC)]
    assert [c.group for c in commits] == ["other", SCHEDULE_GROUP]
    assert store.get_offset("victim", "t", 0) == -1
    assert retry.skipped == 1


@pytest.mark.parametrize("count", [MAX_RECONSUME_TIMES - 1, MAX_RECONSUME_TIMES])
def test_the_reconsume_count_saturates_and_the_message_is_dead_lettered(env, count):
    """A message at the largest count a message holds has no retry left: it goes to the
    DLQ with the count kept at the limit, whatever the group's maximum (one above it
    overflowed the u16 and the send-back failed for ever)."""
    store, retry, _clock = env
    store.put("t", 0, [encode_part(b"z", "Z", 1, reconsume_times=count)])
    res = retry.send_back("g", "t", 0, 1, 0, 10**6)
    if count < MAX_RECONSUME_TIMES:
        assert res == SendBackReply(dlq=False, reconsume=MAX_RECONSUME_TIMES, level=3)
        return
    assert res == SendBackReply(dlq=True, reconsume=MAX_RECONSUME_TIMES)
    [m] = read(store, dlq_topic("g"))
    assert (m.unique_key, m.reconsume_times) == ("Z", MAX_RECONSUME_TIMES)
    assert "limit" in m.properties[PROP_DLQ_REASON]
