"""The demo's pure parts: delivery classification, the proxy's frame reader, chart axes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from onceq.cli.demo.counting import CAUSES, Delivery, classify
from onceq.cli.demo.svg import _axis_max, _step, bar_chart, line_chart
from onceq.cli.demo.trouble import _Frames
from onceq.protocol.codes import RequestCode
from onceq.protocol.frame import REQUEST, RESPONSE, encode_frame

# a delivery: (order, which copy of the order (unique key), member, from the retry topic)
_delivery = st.tuples(st.integers(0, 5), st.integers(0, 2), st.sampled_from("ABK"),
                      st.booleans(), st.integers(0, 3))


@given(st.lists(_delivery, max_size=60), st.floats(0, 60), st.lists(st.floats(0, 60),
                                                                     max_size=2))
def test_every_duplicate_has_exactly_one_cause(rows, kill_t, broker_kills):
    ds = [Delivery(f"d{i}", float(i), member, f"uk-{o}-{copy}", f"o-{o}",
                   "%RETRY%shop" if retry else "orders", pos, o * 10 + copy, 0)
          for i, (o, copy, member, retry, pos) in enumerate(rows)]
    classify(ds, {"K": kill_t}, broker_kills, {d.id for d in ds[::2]})
    firsts = [d for d in ds if d.cause == "first"]
    assert len(firsts) == len({d.order_id for d in ds})  # one first delivery per order
    assert {d.order_id for d in firsts} == {d.order_id for d in ds}
    dups = [d for d in ds if d.cause != "first"]
    assert all(d.cause in CAUSES for d in dups)
    assert len(dups) == len(ds) - len({d.order_id for d in ds})
    assert all(d.outcome == "applied" for d in ds[::2])


def test_causes_follow_the_records():
    def d(i, uk, member="A", topic="orders", q=0, off=0):
        return Delivery(f"d{i}", float(i), member, uk, "o-1", topic, q, off, 0)

    ds = [d(0, "u1", member="K"), d(1, "u1", member="B"),  # K killed at 0.5: redelivered
          d(2, "u2", q=1, off=5),  # another unique key: the application re-sent it
          d(3, "u1", topic="%RETRY%shop"),  # from the retry topic
          d(4, "u1", q=3, off=9),  # same key, another stored copy (no dedup window)
          d(5, "u1", member="C", q=3, off=9),  # broker killed at 4.5
          d(6, "u1", member="A", q=3, off=9)]  # neither: a rebalance
    classify(ds, {"K": 0.5}, [4.5], set())
    assert [x.cause for x in ds] == [
        "first", "member SIGKILLed", "application re-send", "retry (consume later)",
        "producer retry stored twice", "broker SIGKILLed", "rebalance"]


@given(st.lists(st.tuples(st.sampled_from([REQUEST, RESPONSE]),
                          st.sampled_from([RequestCode.SEND, RequestCode.PULL]),
                          st.integers(0, 2**32 - 1), st.binary(max_size=300)), max_size=8),
       st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_frame_reader_finds_every_header_however_the_bytes_are_cut(frames, cuts):
    stream = b"".join(encode_frame(k, c, corr, {"t": "x"}, body) for k, c, corr, body in frames)
    reader, got, pos, i = _Frames(), [], 0, 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        got += reader.feed(stream[pos:pos + n])
        pos, i = pos + n, i + 1
    assert got == [(k, int(c), corr) for k, c, corr, _ in frames]


@given(st.floats(0, 1e7))
def test_axis_is_round_and_covers_the_data(v):
    top = _axis_max(v)
    step = _step(top)
    assert top >= v and top >= 1
    assert 1 <= round(top / step) <= 10 and abs(top / step - round(top / step)) < 1e-6


def test_charts_are_labelled_svg():
    line = line_chart("t", {"deliveries": [(0, 1), (1, 5)]}, ylabel="msgs",
                      events=[(0.5, "broker SIGKILLed")], ticks=("lost send reply", [0.2]))
    assert line.startswith("<svg") and "broker SIGKILLed" in line and "<polyline" in line
    assert "lost send reply (1)" in line and "seconds since start" in line
    bars = bar_chart("b", ["rebalance"], {"on": [3], "off": [7]}, xlabel="duplicates")
    assert bars.count('class="bar"') == 2 and "rebalance" in bars
