"""The view of ``onceq cluster status`` built from what was read (``build_view``): queues
per group, moving queues, stored bytes and the rates between two reads of a leader."""

from __future__ import annotations

from onceq.cli.cluster_cmd import GroupFacts, build_view, route_doc
from onceq.client.cluster_view import group_load, per_second
from onceq.cluster import TopicRoute

ETCD = {"healthy": True, "version": "3.4", "leader": 1}


def _status(log_start: int, log_end: int, messages: int, consumed: int,
            cluster: dict | None = None) -> dict:
    return {"log_start": log_start, "log_end": log_end, "cluster": cluster,
            "counts": {"messages": messages, "consumed": consumed}}


def _facts() -> list[GroupFacts]:
    return [GroupFacts("g2", "1", "h:2", 3, ["1"], 3, {"1": "h:2"}),
            GroupFacts("g1", "1", "h:1", 5, ["1", "2"], 5, {"1": "h:1", "2": "h:3"})]


def _routes() -> dict[str, TopicRoute]:
    orders = TopicRoute("orders", ("g1", "g2", "g1", "g2")).with_move(0, "g2", "sealed")
    return {"orders": orders, "audit": TopicRoute("audit", ("g1", "g1", "g2"))}


def test_per_second_is_none_when_unknown_or_going_back() -> None:
    assert per_second(100, 300, 2.0) == 100.0
    assert per_second(None, 300, 2.0) is None
    assert per_second(300, 100, 2.0) is None  # a restarted broker or another leader
    assert per_second(100, 300, 0.0) is None


def test_the_view_has_each_groups_load_and_the_moving_queues() -> None:
    lead1 = {"role": "leader", "broker_id": "1", "log_end": 5000, "hw": 4900,
             "isr": ["1"], "lag": {"2": 100}}
    reads = {"h:1": (10.0, _status(1000, 5000, 40, 10, lead1)),
             "h:2": (10.0, _status(0, 800, 8, 0, {"role": "leader", "broker_id": "1",
                                                  "log_end": 800, "hw": 800,
                                                  "isr": ["1"], "lag": {}})),
             "h:3": (10.0, _status(0, 4900, 40, 10, {"role": "follower", "broker_id": "2",
                                                     "log_end": 4900, "hw": 4900}))}
    second = {"h:1": (12.0, _status(1000, 9000, 80, 30, lead1)),
              "h:2": (12.5, None)}  # g2's leader out of reach the second time
    view = build_view("c", ETCD, _facts(), _routes(), reads, second, 2.0)
    assert [g["group"] for g in view["groups"]] == ["g1", "g2"]
    g1, g2 = view["groups"]
    assert g1["load"] == {"queues": 4, "queues_by_topic": {"audit": 2, "orders": 2},
                          "moving_out": 1, "moving_in": 0, "bytes": 8000,
                          "write_bytes_s": 2000.0, "write_msgs_s": 20.0,
                          "consume_msgs_s": 10.0, "sampled_s": 2.0}
    assert g2["load"]["queues"] == 3 and g2["load"]["moving_in"] == 1
    assert g2["load"]["bytes"] == 800 and g2["load"]["write_bytes_s"] is None
    assert g1["hw"] == 4900 and g1["published_isr"] == ["1", "2"]
    assert [(m["broker_id"], m["role"], m["lag"], m["in_sync"]) for m in g1["members"]] \
        == [("1", "leader", 0, True), ("2", "follower", 100, False)]
    assert view["routes"]["orders"]["moving"] == [[0, "g2", "sealed"]]
    assert view["routes"]["orders"]["by_group"] == {"g1": [0, 2], "g2": [1, 3]}
    assert view["moving"] == [{"topic": "orders", "queue": 0, "from": "g1", "to": "g2",
                               "phase": "sealed"}]
    assert view["sample_s"] == 2.0 and view["etcd"] == ETCD


def test_without_a_second_read_there_is_no_rate() -> None:
    docs = {t: route_doc(r) for t, r in _routes().items()}
    placement = {t: d["placement"] for t, d in docs.items()}
    moving = {t: d["moving"] for t, d in docs.items()}
    load = group_load("g2", placement, moving, None, (1.0, _status(0, 800, 8, 0)))
    assert load["bytes"] == 800 and load["queues"] == 3
    assert load["write_bytes_s"] is None and load["sampled_s"] is None
    unreachable = group_load("g1", placement, moving, None, (1.0, None))
    assert unreachable["bytes"] is None and unreachable["queues"] == 4
    # a member nobody reaches is "unreachable", not in sync, lag unknown
    view = build_view("c", ETCD, _facts(), {}, {}, None)
    assert [(m["role"], m["lag"]) for m in view["groups"][0]["members"]] == \
        [("unreachable", 0), ("unreachable", None)]
    assert view["routes"] == {} and view["moving"] == []
