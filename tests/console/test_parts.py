"""The console's pure parts: input checks, the duplicate attribution without Spark, the
sample memory, the charts, the metrics parser, the words for failures."""

from __future__ import annotations

import json

import pytest

from onceq.client.connection import ConnectionLost
from onceq.console import forms
from onceq.console.access import describe
from onceq.console.audit import CAUSES, Delivery, Event, attribute, summarize, trace_rows
from onceq.console.charts import duplicates_chart, lag_chart
from onceq.console.metrics import MetricsError, parse
from onceq.console.samples import History, Rates, Sample
from onceq.log.record import MessageExt
from onceq.protocol.errors import ErrorCode, OnceqError


# ---------------------------------------------------------------- input
def test_integers_and_times():
    assert forms.integer(" 42 ", "offset") == 42
    assert forms.optional_integer("", "queue") is None
    assert forms.time_ms("1000", "t") == 1000
    assert forms.time_ms("1970-01-01T00:00:01", "t") == 1000  # UTC when no zone
    assert forms.time_ms("1970-01-01T01:00:01+01:00", "t") == 1000
    assert forms.time_ms("1970-01-01T00:00:01Z", "t") == 1000
    assert forms.iso_ms(1000) == "1970-01-01 00:00:01.000" and forms.iso_ms(None) == "-"
    for bad, says in [("", "offset: required"), ("1.5", "not a whole number"),
                      ("-1", "outside 0.."), (str(1 << 63), "outside 0..")]:
        with pytest.raises(forms.InputError, match=says):
            forms.integer(bad, "offset")
    with pytest.raises(forms.InputError, match="neither an ISO 8601"):
        forms.time_ms("tomorrow", "time")
    with pytest.raises(forms.InputError, match="before 1970"):
        forms.time_ms("1960-01-01T00:00:00", "time")


def test_failures_in_words():
    p = describe(ConnectionLost("cannot connect"), "h:1")
    assert (p.status, p.detail) == (502, "the broker at h:1 cannot be reached: cannot connect")
    assert describe(OnceqError(ErrorCode.TOPIC_NOT_EXIST, "topic 'x' does not exist"),
                    "h:1").status == 404
    p = describe(OnceqError(ErrorCode.UNAUTHENTICATED), "h:1")
    assert p.status == 403 and "ONCEQ_USER" in p.detail
    assert describe(OnceqError(ErrorCode.GROUP_ACTIVE), "h:1").status == 409
    assert describe(forms.InputError("queue: bad"), "h:1").detail == "queue: bad"


# ---------------------------------------------------------------- the audit
def d(client: str, offset: int, key: str, ts: int, *, reconsume: int = 0, queue: int = 0,
      group: str = "g", seq: int = 0) -> Delivery:
    return Delivery(group, client, "t", queue, offset, key, reconsume, ts, seq)


def causes(rows):
    return [(r.delivery.unique_key, r.delivery.ts, r.cause) for r in rows if r.duplicate]


def test_each_cause_follows_the_audit_rules():
    deliveries = [
        d("a", 0, "k0", 10), d("b", 0, "k0", 20),            # moved: rebalance
        d("a", 1, "k1", 10), d("b", 1, "k1", 30),            # a crashed at 25
        d("a", 2, "k2", 10), d("a", 2, "k2", 50),            # broker restarted at 40
        d("a", 3, "k3", 10), d("a", 9, "k3", 60, reconsume=1, queue=1),  # a retry copy
        d("a", 4, "k4", 10), d("a", 5, "k4", 70),            # sent again: producer_resend
        d("a", 6, "k6", 10, group="other"), d("a", 6, "k6", 80, group="other"),
    ]
    events = [Event("member", 25, group="g", client="a", event="disconnect"),
              Event("member", 26, group="g", client="b", event="leave"),  # graceful: no crash
              Event("broker", 40, event="start")]
    rows = attribute(deliveries, events, ["g"])
    assert causes(rows) == [("k0", 20, "rebalance"), ("k1", 30, "crash"),
                            ("k2", 50, "broker_restart"), ("k3", 60, "retry"),
                            ("k4", 70, "producer_resend")]
    # a restart before the previous delivery or after this one is no cause
    rows = attribute([d("a", 0, "k", 10), d("a", 0, "k", 20)],
                     [Event("broker", 5), Event("broker", 21)])
    assert causes(rows) == [("k", 20, "rebalance")]
    # within one millisecond, the order of the records (seq) decides
    rows = attribute([d("a", 0, "k", 10, seq=1), d("a", 0, "k", 10, seq=3)],
                     [Event("broker", 10, seq=2)])
    assert causes(rows) == [("k", 10, "broker_restart")]


def test_summary_adds_up_per_group_and_window():
    rows = attribute([d("a", 0, "k", 1_000), d("b", 0, "k", 61_000), d("b", 1, "j", 61_500)],
                     [])
    s = summarize(rows, 60)
    [g] = s.groups
    assert (g["deliveries"], g["unique_keys"], g["duplicates"]) == (3, 2, 1)
    assert g["causes"] == {**dict.fromkeys(CAUSES, 0), "rebalance": 1}
    assert [(w["start_ms"], w["deliveries"], w["duplicates"]) for w in s.windows] == [
        (0, 1, 0), (60_000, 2, 1)]


def trace_msg(props: dict, body: object = b"", ts: int = 5) -> MessageExt:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return MessageExt("%TRACE%", 0, 0, raw, "u", properties=props, born_ts_ms=ts)


def test_trace_rows_read_only_the_brokers_records():
    base = {"src": "broker", "kind": "deliver", "group": "g", "client": "c", "topic": "t",
            "queue": "2", "handover": "1", "seq": "7"}
    msgs = [trace_msg(base, [{"o": 3, "k": "K", "r": 0}, {"o": 4, "k": "L", "r": 2}]),
            trace_msg({**base, "src": "someone"}, [{"o": 9, "k": "X", "r": 0}]),
            trace_msg({**base, "queue": "two"}, [{"o": 9, "k": "X", "r": 0}]),
            trace_msg({"src": "broker", "kind": "member", "group": "g", "client": "c",
                       "event": "expired"}, ts=9)]
    deliveries, events, skipped = trace_rows(msgs)
    assert deliveries == [Delivery("g", "c", "t", 2, 3, "K", 0, 5, 7, True),
                          Delivery("g", "c", "t", 2, 4, "L", 2, 5, 7, True)]
    assert events == [Event("member", 9, 0, "g", "c", "expired")]
    assert skipped == 2


# ---------------------------------------------------------------- memory and charts
def test_history_is_bounded_and_merges_close_samples():
    now = [0.0]
    h = History(lambda: now[0], max_points=3, keep_s=10, min_interval_s=1, max_groups=2)
    for t in (0.0, 0.5, 2.0, 4.0, 6.0):
        now[0] = t
        h.add("g", {"t[0]": int(t)})
    assert [s.t for s in h.series("g")] == [2.0, 4.0, 6.0]
    assert h.series("g")[0].values == {"t[0]": 2}
    now[0] = 20.0
    h.add("g", {"t[0]": 1})
    assert [s.t for s in h.series("g")] == [20.0]
    h.add("h", {})
    h.add("i", {})
    assert h.series("g") == [] and h.series("i")


def test_rates_from_counters():
    now = [0.0]
    r = Rates(lambda: now[0])
    assert r.rate("in", 10) is None
    now[0] = 2.0
    assert r.rate("in", 30) == 10.0
    now[0] = 3.0
    assert r.rate("in", 5) is None  # the counter went back: the broker restarted


def test_lag_chart_draws_a_line_per_queue_and_the_total():
    samples = [Sample(100.0, {"t[0]": 5, "t[1]": 0}), Sample(102.0, {"t[0]": 3, "t[1]": 4})]
    svg = lag_chart(samples)
    assert svg.count("<polyline") == 3 and "t[0]: 3" in svg and "total: 7" in svg
    assert "<circle" in lag_chart(samples[:1]) and "no sample yet" in lag_chart([])
    assert "&lt;x&gt;" in lag_chart([Sample(1.0, {"<x>": 1})])  # names are escaped


def test_duplicates_chart_stacks_causes():
    w = {"start_ms": 0, "causes": {**dict.fromkeys(CAUSES, 0), "crash": 2, "retry": 1}}
    svg = duplicates_chart([w], CAUSES)
    assert svg.count("<rect") == 2 + len(CAUSES) and "crash: 2" in svg
    assert "no traced delivery" in duplicates_chart([], CAUSES)


def test_metrics_text_is_parsed():
    m = parse('# TYPE onceq_messages_in_total counter\n'
              'onceq_messages_in_total{topic="a"} 3\nonceq_messages_in_total{topic="b"} 4\n'
              '# TYPE onceq_connections gauge\nonceq_connections 2\n')
    assert m.value("onceq_messages_in_total") == 7 and m.value("onceq_connections") == 2
    assert m.by("onceq_messages_in_total", "topic") == {"a": 3, "b": 4}
    assert m.value("nothing") is None
    with pytest.raises(MetricsError):
        parse("this is { not metrics")
