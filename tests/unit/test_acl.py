"""The ACL model without a broker: the one table of request types, grants and decisions."""

from __future__ import annotations

import json

import pytest

from onceq.broker.acl import (
    REQUIRED,
    AclStore,
    AclTable,
    Action,
    Decision,
    Kind,
    Need,
    make_grant,
    required,
)
from onceq.protocol import requests as rq
from onceq.protocol.schema import Message, message


def test_every_request_type_is_in_the_table_and_an_unknown_one_is_refused():
    assert set(REQUIRED) == set(rq.REQUESTS.values())

    @message(999)
    class Stranger(Message):
        pass

    assert required(Stranger()) is None


def test_a_pull_needs_the_topic_and_the_group_and_a_retry_topic_is_the_groups():
    pull = rq.Pull("orders", 0, 0, group="g")
    assert required(pull) == [Need(Kind.TOPIC, "orders", Action.SUB),
                              Need(Kind.GROUP, "g", Action.SUB)]
    assert required(rq.Pull("%RETRY%g", 0, 0, group="g")) == [Need(Kind.GROUP, "g", Action.SUB)]
    assert required(rq.Pull("%DLQ%g", 0, 0)) == [Need(Kind.GROUP, "g", Action.SUB)]
    assert required(rq.SendBack("g", "orders", 0, 1, resend=True)) == [
        Need(Kind.GROUP, "g", Action.UPDATE)]
    beat = rq.Heartbeat("c", [rq.GroupBeat("a", {}), rq.GroupBeat("b", {})])
    assert required(beat) == [Need(Kind.GROUP, "a", Action.SUB), Need(Kind.GROUP, "b", Action.SUB)]


def _table(*grants):
    return AclTable([make_grant(*g) for g in grants])


def allowed(table, user, kind, name, action, source="10.0.0.1"):
    return table.decide(user, Need(kind, name, action), source)[0] is Decision.ALLOW


def test_without_a_grant_the_answer_is_deny():
    assert not allowed(AclTable(), "alice", Kind.TOPIC, "orders", Action.PUB)


def test_exact_prefix_and_wildcard_names():
    t = _table(("alice", "topic", "orders", ["Pub"]), ("alice", "topic", "log-*", ["Sub"]),
               ("bob", "group", "*", ["Sub"]))
    assert allowed(t, "alice", Kind.TOPIC, "orders", Action.PUB)
    assert not allowed(t, "alice", Kind.TOPIC, "orders2", Action.PUB)
    assert allowed(t, "alice", Kind.TOPIC, "log-a", Action.SUB)
    assert not allowed(t, "alice", Kind.TOPIC, "log-a", Action.PUB)
    assert not allowed(t, "alice", Kind.GROUP, "orders", Action.PUB)  # another kind
    assert allowed(t, "bob", Kind.GROUP, "anything", Action.SUB)
    assert not allowed(t, "alice", Kind.GROUP, "anything", Action.SUB)  # another user


def test_a_wildcard_never_reaches_the_brokers_topics():
    t = _table(("ops", "topic", "*", ["Sub", "Get"]), ("audit", "topic", "%TRACE%", ["Sub"]))
    assert allowed(t, "ops", Kind.TOPIC, "orders", Action.SUB)
    assert not allowed(t, "ops", Kind.TOPIC, "%TRACE%", Action.SUB)
    assert allowed(t, "audit", Kind.TOPIC, "%TRACE%", Action.SUB)  # named exactly


def test_pub_and_sub_imply_get_not_the_reverse():
    t = _table(("p", "topic", "orders", ["Pub"]), ("g", "topic", "orders", ["Get"]))
    assert allowed(t, "p", Kind.TOPIC, "orders", Action.GET)
    assert not allowed(t, "g", Kind.TOPIC, "orders", Action.PUB)
    assert not allowed(t, "p", Kind.TOPIC, "orders", Action.DELETE)


def test_deny_wins_over_any_allow():
    t = _table(("alice", "topic", "*", ["Pub", "Sub"]),
               ("alice", "topic", "secret-*", ["Sub"], "Deny"))
    assert allowed(t, "alice", Kind.TOPIC, "orders", Action.SUB)
    assert not allowed(t, "alice", Kind.TOPIC, "secret-x", Action.SUB)
    assert allowed(t, "alice", Kind.TOPIC, "secret-x", Action.PUB)
    decision, why = t.decide("alice", Need(Kind.TOPIC, "secret-x", Action.SUB), None)
    assert decision is Decision.DENY and "secret-*" in why


def test_a_source_condition_limits_where_from():
    t = _table(("alice", "topic", "orders", ["Pub"], "Allow", ["10.1.0.0/16"]))
    assert allowed(t, "alice", Kind.TOPIC, "orders", Action.PUB, "10.1.2.3")
    assert not allowed(t, "alice", Kind.TOPIC, "orders", Action.PUB, "10.2.0.1")
    assert not allowed(t, "alice", Kind.TOPIC, "orders", Action.PUB, None)


@pytest.mark.parametrize("args, word", [
    (("u", "queue", "x", ["Pub"]), "kinds are"),
    (("u", "topic", "x", ["Publish"]), "actions"),
    (("u", "topic", "x", []), "at least one action"),
    (("u", "topic", "a*b", ["Pub"]), "prefix ending in *"),
    (("u", "topic", "x", ["Pub"], "Maybe"), "decisions"),
    (("u", "topic", "x", ["Pub"], "Allow", ["not-a-net"]), "not an address"),
])
def test_a_bad_grant_is_refused_with_what_is_wrong(args, word):
    with pytest.raises(ValueError, match=word):
        make_grant(*args)


def test_grants_survive_a_restart_and_a_damaged_file_is_a_clear_error(tmp_path):
    store = AclStore(str(tmp_path))
    g = make_grant("alice", "Topic", "orders", ["pub", "SUB"], "allow", ["10.0.0.0/8"])
    assert store.grant(g) and not store.grant(g)
    store.save()
    again = AclStore(str(tmp_path))
    assert again.list() == [g] and again.list("bob") == []
    assert again.revoke(g) and not again.revoke(g)
    (tmp_path / "acls.json").write_text(json.dumps({"grants": [{"user": "x"}]}))
    with pytest.raises(ValueError, match="cannot read the ACL grants"):
        AclStore(str(tmp_path))
