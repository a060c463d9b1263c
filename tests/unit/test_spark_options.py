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
    assert o.starting == {0: 5, 2: -2}
    assert o.max_messages_per_trigger == 9
    assert not o.fail_on_data_loss and o.group == "g1"
    assert o.starting_timestamp == 1_700_000_000_000


@pytest.mark.parametrize("options, message", [
    ({}, "'topic' is required"),
    ({"topic": "t", "queues": "a,b"}, "'queues' must be queue numbers"),
    ({"topic": "t", "startingOffsets": "first"}, "'startingOffsets' must be 'earliest'"),
    ({"topic": "t", "startingOffsets": '{"u": {"0": 1}}'}, "must map the topic 't'"),
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
    assert resolve("earliest", 0, bounds) == 10
    assert resolve("latest", 0, bounds) == 50
    spec = {0: 20, 1: -1, 2: -2}
    assert [resolve(spec, q, bounds) for q in (0, 1, 2, 3)] == [20, 50, 10, 10]


def test_data_loss_fails_with_the_range_or_skips():
    assert check_loss("t", 1, 30, 10, fail=True) == 30
    with pytest.raises(DataLossError, match=r"offsets 3\.\.9 of t/1 \(7 messages\)"):
        check_loss("t", 1, 3, 10, fail=True)
    assert check_loss("t", 1, 3, 10, fail=False) == 10


def test_checkpoint_offsets_round_trip_and_refuse_another_topic():
    offsets = to_offsets("a.b", {1: 5, 0: 7})
    assert offsets == {"a.b/0": 7, "a.b/1": 5}
    assert from_offsets("a.b", offsets) == {0: 7, 1: 5}
    with pytest.raises(OptionError, match="new checkpoint"):
        from_offsets("other", offsets)


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
