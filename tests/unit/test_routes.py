"""Routes of topics spread over broker groups (``cluster/_routes.py``): the even
placement, and the route document read back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceq.cluster import HANDOVER, SEALED, TopicRoute, apply_events, place
from onceq.cluster._etcd import KeyValue, WatchEvent
from onceq.cluster._routes import route_key

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


def _event(cluster: str, route: TopicRoute, kind: str = "PUT") -> WatchEvent:
    key = route_key(cluster, route.topic)
    return WatchEvent(kind, KeyValue(key, json.dumps(route.to_json()).encode(), 1, 1, 1, 0))


def test_watched_changes_apply_in_version_order() -> None:
    """A watch event older than the route already known (read again under the watch) is
    left out; a newer one, a delete and a damaged document are applied as etcd says."""
    v1 = TopicRoute("t", ("g1", "g2"), 1)
    v2 = v1.with_move(0, "g2", SEALED)
    v3 = v2.with_move(0, "g2", None)
    routes = {"t": v3}
    assert apply_events("c", routes, [_event("c", v2)]) == [] and routes["t"] == v3
    other = TopicRoute("u", ("g1",), 1)
    assert apply_events("c", routes, [_event("c", other), _event("c", v3, "DELETE")]
                        ) == ["u", "t"]
    assert routes == {"u": other}
    bad = WatchEvent("PUT", KeyValue(route_key("c", "x"), b"{", 1, 1, 1, 0))
    assert apply_events("c", routes, [bad]) == [] and "x" not in routes


def test_a_queue_moves_through_its_phases() -> None:
    r = TopicRoute("t", ("g1", "g2", "g1"), 4)
    sealed = r.with_move(2, "g3", SEALED)
    assert sealed.version == 5 and sealed.move_of(2) == ("g3", SEALED)
    assert sealed.placement == r.placement and sealed.move_of(0) is None
    handed = sealed.with_move(2, "g3", HANDOVER)
    assert TopicRoute.from_json("t", handed.to_json()) == handed
    done = handed.with_move(2, "g3", None)
    assert done.placement == ("g1", "g2", "g3") and done.moving == () and done.version == 7
    with pytest.raises(ValueError):
        TopicRoute.from_json("t", {**handed.to_json(), "moving": [[9, "g3", SEALED]]})
