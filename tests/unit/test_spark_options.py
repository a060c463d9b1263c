"""The Spark source's options, positions and admission control (pure, no Spark)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.spark.options import (
    DataLossError,
    OptionError,
    SourceOptions,
    admit,
    check_loss,
    from_offsets,
    resolve,
    split_range,
    to_offsets,
)


def test_defaults_follow_the_kafka_source():
    batch = SourceOptions.parse({"topic": "orders"}, streaming=False)
    stream = SourceOptions.parse({"topic": "orders"}, streaming=True)
    assert (batch.starting, batch.ending) == ("earliest", "latest")
    assert stream.starting == "latest"
    assert batch.servers == "127.0.0.1:9876" and batch.fail_on_data_loss
    assert stream.max_messages_per_trigger is None and batch.queues is None
    # a stable, valid group name per query definition
    assert stream.group == SourceOptions.parse({"topic": "orders"}, streaming=True).group
    assert re.fullmatch(r"spark-orders-[0-9a-f]{10}", stream.group)
    other = SourceOptions.parse({"topic": "orders", "startingOffsets": "earliest"},
                                streaming=True)
    assert other.group != stream.group


def test_options_are_case_insensitive_and_parsed():
    o = SourceOptions.parse({"TOPIC": "t", "Queues": "2, 0,2", "startingoffsets":
                             '{"t": {"0": 5, "2": -2}}', "MAXOFFSETSPERTRIGGER": "9",
                             "failOnDataLoss": "false", "group": "g1",
                             "startingTimestamp": "1700000000000"}, streaming=True)
    assert o.queues == (0, 2)
    assert o.starting == {"t": {0: 5, 2: -2}}
    assert o.max_messages_per_trigger == 9
    assert not o.fail_on_data_loss and o.group == "g1"
    assert o.starting_timestamp == 1_700_000_000_000


@pytest.mark.parametrize("options, message", [
    ({}, "give exactly one of the options 'topic', 'topics'"),
    ({"topic": "t", "topics": "a,b"}, "'topicPattern' (a regular expression), not 2"),
    ({"topicPattern": "(a"}, "'topicPattern' is not a regular expression"),
    ({"topics": " , "}, "names no topic"),
    ({"topics": "a,b", "queues": "0"}, "'queues' needs a single 'topic'"),
    ({"topic": "t", "bodyFormat": "avro"}, "must be binary or json"),
    ({"topic": "t", "bodyFormat": "json"}, "needs 'bodySchema'"),
    ({"topic": "t", "bodySchema": "a INT"}, "'bodySchema' needs bodyFormat=json"),
    ({"topic": "t", "includeBody": "false"}, "'includeBody' false needs bodyFormat=json"),
    ({"topic": "t", "queues": "a,b"}, "'queues' must be queue numbers"),
    ({"topic": "t", "startingOffsets": "first"}, "'startingOffsets' must be 'earliest'"),
    ({"topic": "t", "startingOffsets": '{"u": {"0": 1}}'}, "topics the query does not read"),
    ({"topic": "t", "startingOffsets": '{"t": 1}'}, "must map topics to positions per queue"),
    ({"topic": "t", "startingOffsets": '{"t": {"0": -3}}'}, "offsets are >= 0"),
    ({"topic": "t", "maxMessagesPerTrigger": "0"}, "must be >= 1"),
    ({"topic": "t", "failOnDataLoss": "maybe"}, "must be true or false"),
    ({"topic": "t", "endingOffsets": "latest"}, "for batch reads only"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        SourceOptions.parse(options, streaming=True)


def test_positions_resolve_per_queue():
    bounds = (10, 50)
    assert resolve("earliest", ("t", 0), bounds) == 10
    assert resolve("latest", ("t", 0), bounds) == 50
    spec = {"t": {0: 20, 1: -1, 2: -2}}
    assert [resolve(spec, ("t", q), bounds) for q in (0, 1, 2, 3)] == [20, 50, 10, 10]
    assert resolve(spec, ("u", 0), bounds) == 10  # a topic the JSON does not name


def test_topics_and_pattern_subscriptions():
    o = SourceOptions.parse({"topics": "b, a,b", "startingOffsets":
                             '{"a": {"0": 3}, "b": {"1": -1}}'}, streaming=True)
    assert o.topics == ("b", "a") and o.topic_pattern is None
    assert o.starting == {"a": {0: 3}, "b": {1: -1}}
    assert o.subscribes("a") and not o.subscribes("c")
    assert re.fullmatch(r"spark-topics-[0-9a-f]{10}", o.group)
    p = SourceOptions.parse({"topicPattern": r"orders\.\w+"}, streaming=True)
    assert p.topics == () and p.subscribes("orders.eu") and not p.subscribes("xorders.eu")
    assert not p.subscribes("orders.eu.old")  # the whole name matches
    assert re.fullmatch(r"spark-pattern-[0-9a-f]{10}", p.group)
    with pytest.raises(OptionError, match="does not read"):
        SourceOptions.parse({"topicPattern": "orders.*", "startingOffsets":
                             '{"refunds": {"0": 1}}'}, streaming=True)


def test_body_options():
    o = SourceOptions.parse({"topic": "t", "bodyFormat": "JSON", "bodySchema": "a INT",
                             "includeBody": "false"}, streaming=False)
    assert (o.body_format, o.body_schema, o.include_body) == ("json", "a INT", False)
    assert SourceOptions.parse({"topic": "t"}, streaming=False).body_format == "binary"


def test_data_loss_fails_with_the_range_or_skips():
    assert check_loss("t", 1, 30, 10, fail=True) == 30
    with pytest.raises(DataLossError, match=r"offsets 3\.\.9 of t/1 \(7 messages\)"):
        check_loss("t", 1, 3, 10, fail=True)
    assert check_loss("t", 1, 3, 10, fail=False) == 10


def test_checkpoint_offsets_round_trip_and_refuse_another_topic():
    offsets = to_offsets({("a.b", 1): 5, ("a.b", 0): 7, ("a", 0): 1})
    assert offsets == {"a": {"0": 1}, "a.b": {"0": 7, "1": 5}}
    both = SourceOptions.parse({"topics": "a,a.b"}, streaming=True)
    assert from_offsets(both, offsets) == {("a", 0): 1, ("a.b", 0): 7, ("a.b", 1): 5}
    # checkpoints of earlier versions: {"topic/queue": offset}
    assert from_offsets(both, {"a/0": 1, "a.b/1": 5}) == {("a", 0): 1, ("a.b", 1): 5}
    with pytest.raises(OptionError, match="new checkpoint"):
        from_offsets(SourceOptions.parse({"topic": "a.b"}, streaming=True), offsets)


def test_split_range():
    assert split_range(5, 5, 3) == []
    assert split_range(0, 7, None) == [(0, 7)]
    assert split_range(0, 7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_admission_shares_the_budget_and_passes_on_what_a_queue_cannot_use():
    start = {0: 0, 1: 0, 2: 0}
    latest = {0: 2, 1: 100, 2: 100}
    assert admit(start, latest, None) == latest
    assert admit(start, latest, 30) == {0: 2, 1: 14, 2: 14}
    assert admit(start, latest, 1000) == latest


@given(st.dictionaries(st.integers(0, 7), st.tuples(st.integers(0, 50), st.integers(0, 50)),
                       min_size=1), st.one_of(st.none(), st.integers(1, 120)))
def test_admission_stays_inside_the_backlog_and_the_limit(queues, max_rows):
    start = {q: a for q, (a, _n) in queues.items()}
    latest = {q: a + n for q, (a, n) in queues.items()}
    end = admit(start, latest, max_rows)
    assert all(start[q] <= end[q] <= latest[q] for q in queues)
    taken = sum(end[q] - start[q] for q in queues)
    backlog = sum(latest[q] - start[q] for q in queues)
    assert taken == (backlog if max_rows is None else min(backlog, max_rows))
    if max_rows is not None:  # fair: a queue left with a backlog got at least the others less 1
        short = [end[q] - start[q] for q in queues if end[q] < latest[q]]
        if short:
            assert max(end[q] - start[q] for q in queues) - min(short) <= 1
