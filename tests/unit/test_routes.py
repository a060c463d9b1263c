"""Routes of topics spread over broker groups (``cluster/_routes.py``): the even
placement, and the route document read back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.cluster import TopicRoute, place

GROUPS = st.lists(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=1,
                  max_size=6, unique=True)


@given(st.integers(1, 300), GROUPS)
def test_queues_spread_evenly_over_the_groups(queues: int, groups: list[str]) -> None:
    placement = place(queues, groups)
    assert len(placement) == queues and set(placement) <= set(groups)
    counts = [placement.count(g) for g in groups]
    assert max(counts) - min(counts) <= 1  # each holds Q // G or one more
    assert place(queues, list(reversed(groups))) == placement  # the order given is moot
    route = TopicRoute("t", placement, 3)
    assert TopicRoute.from_json("t", route.to_json()) == route
    assert sorted(q for g in route.groups for q in route.queues_of(g)) == list(range(queues))
    assert all(route.group_of(q) == placement[q] for q in range(queues))


def test_bad_placements_and_documents_are_refused() -> None:
    with pytest.raises(ValueError, match="no broker group"):
        place(4, [])
    with pytest.raises(ValueError, match="at least one queue"):
        place(0, ["g1"])
    with pytest.raises(ValueError, match="invalid group"):
        place(2, ["g/1"])
    for doc in ({"queues": 2, "placement": ["g1"]}, {"placement": ["g1"]}, [],
                {"queues": 1, "placement": ["bad/name"]}):
        with pytest.raises(ValueError):
            TopicRoute.from_json("t", doc)
    with pytest.raises(ValueError, match="out of range"):
        TopicRoute("t", ("g1",)).group_of(1)
