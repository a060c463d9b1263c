"""Clients made without a client id in one process get distinct ids: the broker binds an
id to one connection, so a pull consumer next to a push consumer must not share its id."""

from onceq import PullConsumer
from onceq.client.push import PushConsumer


def test_default_ids_are_distinct_across_client_kinds():
    ids = [PushConsumer("127.0.0.1:1", "g").client_id, PullConsumer("127.0.0.1:1", "g").client_id,
           PullConsumer("127.0.0.1:1", "h").client_id, PushConsumer("127.0.0.1:1", "h").client_id]
    assert len(set(ids)) == 4
    assert all("@" in i and "#DEFAULT" in i for i in ids)
