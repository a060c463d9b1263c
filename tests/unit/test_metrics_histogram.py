"""The broker's fixed-bucket latency histogram (broker/metrics.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from onceq.broker.metrics import LATENCY_BUCKETS, Histogram


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=200))
def test_cumulative_buckets(values):
    h = Histogram()
    for v in values:
        h.observe(v)
    buckets = h.buckets()
    assert [b for b, _ in buckets] == [*map(repr, LATENCY_BUCKETS), "+Inf"]
    counts = [c for _, c in buckets]
    assert counts == sorted(counts) and counts[-1] == len(values)
    for bound, c in zip(LATENCY_BUCKETS, counts, strict=False):
        assert c == sum(1 for v in values if v <= bound)  # "le": upper bounds included
    assert abs(h.sum - sum(values)) < 1e-6
